"""Sampling without a model: top-p / min-p at their exact boundaries, seeds, the three penalties against
hand arithmetic, and the one-line errors of SamplingParams."""
from __future__ import annotations

import math

import pytest
import torch

from bie_trt import RequestError, SamplingParams
from bie_trt.sampling import apply_penalties, make_generator, probabilities, sample_next


def kept(probs: list[float], **params) -> list[int]:
    """Indices that `probabilities` leaves a non-zero chance, for logits whose softmax is `probs`."""
    p = probabilities(torch.log(torch.tensor(probs)), SamplingParams(**params))
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    return p.nonzero().flatten().tolist()


# --- top-p: the smallest prefix whose mass reaches top_p ------------------------------------------

def test_top_p_exactly_reached_by_a_prefix_keeps_just_that_prefix():
    p = probabilities(torch.log(torch.tensor([0.5, 0.25, 0.25])), SamplingParams(top_p=0.75))
    assert (p > 0).sum() == 2 and math.isclose(float(p.max()), 2 / 3, rel_tol=1e-6)
    assert kept([0.4, 0.3, 0.2, 0.1], top_p=0.7) == [0, 1]
    assert kept([0.4, 0.3, 0.2, 0.1], top_p=0.9) == [0, 1, 2]
    assert kept([0.4, 0.3, 0.2, 0.1], top_p=0.7 + 1e-3) == [0, 1, 2]   # just past the boundary: one more
    assert kept([0.6, 0.3, 0.1], top_p=0.6) == [0]                     # the first token alone reaches it


@pytest.mark.parametrize("n", range(2, 12))
def test_top_p_over_a_uniform_distribution_keeps_k_of_n(n):
    for k in range(1, n):
        assert len(kept([1 / n] * n, top_p=k / n)) == k, (k, n)


def test_top_p_boundary_holds_over_a_large_vocabulary():
    # float32 softmax over 50k entries sums to 1 only within ~1e-4: the mass is judged against the total.
    n = 50_000
    probs = [0.5] + [0.5 / n] * n
    for top_p in (0.6, 0.75, 0.9):
        assert len(kept(probs, top_p=top_p)) == 1 + round((top_p - 0.5) * 2 * n)


# --- min-p: keep what is at least min_p x the most likely token -----------------------------------

@pytest.mark.parametrize("probs", [[0.4, 0.3, 0.2, 0.1], [0.6, 0.3, 0.1], [0.35, 0.25, 0.2, 0.15, 0.05]])
def test_min_p_keeps_a_token_exactly_at_the_threshold(probs):
    for q in probs[1:]:
        # min_p = q / max: q itself and everything above stay, everything below goes
        assert kept(probs, min_p=q / probs[0]) == [i for i, x in enumerate(probs) if x >= q], q
        assert kept(probs, min_p=q / probs[0] * 1.001) == [i for i, x in enumerate(probs) if x > q], q


def test_top_k_keeps_the_k_most_likely_and_ties_at_the_kth():
    assert kept([0.4, 0.3, 0.2, 0.1], top_k=2) == [0, 1]
    assert kept([0.1, 0.2, 0.3, 0.4], top_k=1) == [3]
    assert kept([0.4, 0.2, 0.2, 0.2], top_k=2) == [0, 1, 2, 3]     # equal logits cannot be told apart
    for off in (0, -1, 4, 9):
        assert kept([0.4, 0.3, 0.2, 0.1], top_k=off) == [0, 1, 2, 3]


def test_filters_compose_and_renormalise():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    p = probabilities(logits, SamplingParams(top_k=3, min_p=0.5, top_p=0.99))
    torch.testing.assert_close(p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]))
    p = probabilities(logits, SamplingParams(top_k=3, top_p=0.5))    # top_k first: [4, 3, 2] / 9, then top_p
    torch.testing.assert_close(p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


# --- seeds ------------------------------------------------------------------------------------------

def draws(g: torch.Generator) -> list[int]:
    return torch.randint(0, 2**31, (8,), generator=g).tolist()


def test_seed_zero_is_a_seed_not_a_missing_one():
    zero = draws(make_generator(SamplingParams(seed=0), fallback_seed=7))
    assert zero == draws(torch.Generator().manual_seed(0))
    assert zero == draws(make_generator(SamplingParams(seed=0), fallback_seed=8))   # reproducible
    assert zero != draws(make_generator(SamplingParams(), fallback_seed=7))         # not the unseeded draw
    assert draws(make_generator(SamplingParams(), 7)) == draws(torch.Generator().manual_seed(7))


def test_sample_next_follows_the_generator():
    logits = torch.zeros(1000)
    params = SamplingParams(seed=3)
    a = [sample_next(logits, params, make_generator(params, 0), [], []) for _ in range(2)]
    b = sample_next(logits, params, make_generator(SamplingParams(seed=4), 0), [], [])
    assert a[0] == a[1] and a[0] != b


# --- penalties, by hand --------------------------------------------------------------------------
# logits of tokens 0..4; the prompt holds 0 and 1, the output 2 (twice) and 4.
LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT, OUTPUT = [0, 1, 1], [2, 4, 2]


def penalised(**params) -> list[float]:
    return apply_penalties(torch.tensor(LOGITS), SamplingParams(**params), PROMPT, OUTPUT).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_every_seen_token():
    # seen = prompt and output: 0, 1, 2, 4; token 3 never appeared
    assert penalised(repetition_penalty=2.0) == [1.0, -2.0, 0.25, 3.0, -4.0]
    assert penalised(repetition_penalty=0.5) == [4.0, -0.5, 1.0, 3.0, -1.0]   # < 1 encourages repeats


def test_presence_and_frequency_penalties_count_output_tokens_only():
    # presence: once per distinct output token; frequency: per occurrence (token 2 twice, token 4 once)
    assert penalised(presence_penalty=0.5) == [2.0, -1.0, 0.0, 3.0, -2.5]
    assert penalised(frequency_penalty=0.25) == [2.0, -1.0, 0.0, 3.0, -2.25]
    assert penalised(presence_penalty=-1.0, frequency_penalty=1.0) == [2.0, -1.0, -0.5, 3.0, -2.0]
    # all three: repetition first, then presence and frequency
    assert penalised(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25) == \
        [1.0, -2.0, -0.75, 3.0, -4.75]


def test_a_repetition_penalty_in_range_keeps_the_largest_fp16_logits_finite():
    """The bounds are where dividing an fp16 logit (|x| <= 65504) by the penalty and the smallest temperature
    still gives finite probabilities; 1e-30, which the range refuses, makes them NaN."""
    from bie_trt.sampling_params import REPETITION_PENALTY_RANGE
    from bie_trt.sampling import MIN_TEMPERATURE, probabilities

    logits = torch.tensor([65504.0, -65504.0, 60000.0, 0.0])

    def probs(penalty: float) -> torch.Tensor:
        params = SamplingParams(temperature=MIN_TEMPERATURE)
        params.repetition_penalty = penalty      # past validation, as a caller editing an instance would
        return probabilities(apply_penalties(logits.clone(), params, [0, 1, 2], []), params)

    for penalty in REPETITION_PENALTY_RANGE:
        assert torch.isfinite(probs(penalty)).all()
    assert probs(1e-30).isnan().any()


def test_penalties_change_the_greedy_choice_and_leave_the_callers_logits_alone():
    logits = torch.tensor([3.0, 2.9, 0.0])
    before = logits.clone()
    assert sample_next(logits, SamplingParams(temperature=0), torch.Generator(), [], [0]) == 0
    assert sample_next(logits, SamplingParams(temperature=0, presence_penalty=0.5), torch.Generator(), [], [0]) == 1
    assert sample_next(logits, SamplingParams(temperature=0, repetition_penalty=1.1), torch.Generator(), [0], []) == 1
    assert torch.equal(logits, before)


# --- one-line errors ---------------------------------------------------------------------------
# Each names the parameter, the value it got, and what it accepts.

@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 is greedy); got -0.5."),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0 (0 is greedy); got inf."),
    ({"top_p": 0.0}, "top_p must be in (0, 1]; got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1]; got 1.5."),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]; got nan."),
    ({"top_k": -2}, "top_k must be an integer >= 0 (0 or -1 disables it); got -2."),
    ({"top_k": 2.5}, "top_k must be an integer >= 0 (0 or -1 disables it); got 2.5."),
    ({"min_p": 1.01}, "min_p must be in [0, 1]; got 1.01."),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1; got 0."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 10] (1 is off); got 0.0."),
    ({"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 10] (1 is off); got 1e-30."),
    ({"repetition_penalty": 10.5}, "repetition_penalty must be in [0.01, 10] (1 is off); got 10.5."),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be in [0.01, 10] (1 is off); got nan."),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]; got 2.5."),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]; got -3."),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2]; got nan."),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]; got 21."),
    ({"seed": 2**64}, f"seed must be an integer in [-2**63, 2**64); got {2**64}."),
    ({"seed": 1.5}, "seed must be an integer in [-2**63, 2**64); got 1.5."),
])
def test_bad_sampling_params_are_one_line_naming_the_parameter_and_its_range(kwargs, message):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message
    params = SamplingParams()               # validate() catches the same on an edited instance
    for name, value in kwargs.items():
        setattr(params, name, value)
    with pytest.raises(RequestError, match=list(kwargs)[0]):
        params.validate()


def test_boundary_values_are_accepted():
    for kwargs in ({"temperature": 0}, {"top_p": 1.0}, {"top_k": -1}, {"min_p": 0.0}, {"min_p": 1.0},
                   {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"logprobs": 0}, {"logprobs": 20},
                   {"seed": 0}, {"seed": -1}, {"seed": 2**64 - 1}, {"max_tokens": 1},
                   {"repetition_penalty": 0.01}, {"repetition_penalty": 10}):
        SamplingParams(**kwargs)
        make_generator(SamplingParams(**kwargs), 0)


@pytest.mark.parametrize("params, fragment", [
    (dict(thinking_budget=-1), "thinking_budget must be an integer >= 0"),
    (dict(thinking_budget=True), "thinking_budget must be an integer >= 0"),
    (dict(thinking_budget=4, structured_outputs={"regex": "a+"}), "a constrained reply is shaped whole"),
])
def test_a_thinking_budget_is_checked(params, fragment):
    with pytest.raises(RequestError, match=fragment):
        SamplingParams(**params)
