"""A step's rows sampled in one batch (`executor/sampler.py`): each row comes out as it would alone (its
constraint, penalties and filters stay in its row), greedy rows as the host sampler picks them, a seeded
draw is the exponential race under (its seed, its position), the race follows the distribution, and the
logprobs are each row's own. No model: random logits over a small vocabulary."""
from __future__ import annotations

import pytest
import torch

from bie_trt.executor.sampler import sample_step
from bie_trt.executor.sequence import Sequence
from bie_trt.sampling import (apply_penalties, exponential, make_generator, penalise_rows, probabilities, process_logits,
                              race_key, race_noise, sample_next, top_logprobs)
from bie_trt.logits_constraint import LogitsConstraint, RowConstraint, apply_constraints
from bie_trt.sampling_params import SamplingParams

V = 300
EOS = 2
PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 3.0}),
    SamplingParams(temperature=0.8, top_k=20, seed=5, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=1.1, top_p=0.7, min_p=0.02, seed=9, logprobs=3),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.9, repetition_penalty=3.0, min_tokens=4),
    SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0),
    SamplingParams(temperature=1.0, seed=9),   # row 2's seed at another position: another draw
]


def make_seqs(params: list[SamplingParams], outputs: int, rows: list[torch.Tensor]) -> list[Sequence]:
    """Sequences whose prompt and output hold their row's likeliest tokens, so that penalties change the draw."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for i, (p, row) in enumerate(zip(params, rows)):
        top = row.topk(4).indices.tolist()
        seq = Sequence(top[2:] + torch.randint(0, V, (4,), generator=g).tolist(), p, make_generator(p, 100 + i))
        seq.output_ids = (top[:2] if outputs else []) + torch.randint(0, V, (outputs + i,), generator=g).tolist()
        seq.constraint = LogitsConstraint.build(p, [EOS], None)
        seqs.append(seq)
    return seqs


def rows_for(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, generator=g) * 3 for _ in range(n)]


def constraint_rows(seqs: list[Sequence]) -> list[RowConstraint | None]:
    return [s.constraint.row(len(s.output_ids)) if s.constraint is not None else None for s in seqs]


@pytest.mark.parametrize("outputs", [0, 3, 9])
def test_each_row_of_a_batch_is_sampled_as_it_is_alone(outputs):
    """Penalties, logit_bias, min_tokens, filters, seeds and logprobs of one row never reach another: the batch
    gives every row what the same row gives alone."""
    rows = rows_for(len(PARAMS), outputs)
    seqs = make_seqs(PARAMS, outputs, rows)
    together = sample_step(seqs, rows, constraint_rows(seqs))
    alone = [sample_step([s], [r], constraint_rows([s])) for s, r in zip(seqs, rows)]
    assert together[0] == [a[0][0] for a in alone]
    assert together[1] == [a[1][0] for a in alone]
    assert len(set(together[0])) > 3   # the rows differ: a row's knobs applied to all would show


def test_greedy_rows_are_the_host_samplers_argmax():
    rows = rows_for(len(PARAMS), 7)
    seqs = make_seqs(PARAMS, 5, rows)
    tokens, _ = sample_step(seqs, rows, constraint_rows(seqs))
    for i, (seq, row) in enumerate(zip(seqs, rows)):
        if seq.params.temperature == 0:
            assert tokens[i] == sample_next(row, seq.params, torch.Generator(), seq.prompt_ids, seq.output_ids,
                                            seq.constraint), i


def test_a_seeded_draw_is_the_race_under_its_seed_and_output_position():
    """The token drawn for a row is argmax(p / E), p the row's filtered distribution and E the noise of
    race_key(its seed, the number of tokens it generated)."""
    for outputs in (0, 4):
        rows = rows_for(len(PARAMS), 11 + outputs)
        seqs = make_seqs(PARAMS, outputs, rows)
        tokens, _ = sample_step(seqs, rows, constraint_rows(seqs))
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            if seq.params.temperature == 0:
                continue
            processed = process_logits(row.clone(), seq.params, seq.prompt_ids, seq.output_ids, seq.constraint)
            key = race_key(seq.params.seed if seq.params.seed is not None else 100 + i, len(seq.output_ids))
            noise = race_noise(torch.tensor([key]), V)[0]
            assert tokens[i] == int((probabilities(processed, seq.params) / noise).argmax()), (outputs, i)


def test_the_race_follows_the_distribution():
    """40,000 draws (seeds x positions) of a filtered distribution of 12 tokens: chi-square against it."""
    logits = torch.log(torch.tensor([0.2, 0.15, 0.12, 0.1, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.02, 0.01]))
    params = SamplingParams(temperature=1.3, top_p=0.97)
    p = probabilities(logits, params)
    keys = torch.tensor([race_key(seed, pos) for seed in range(4000) for pos in range(10)])
    draws = (p / race_noise(keys, len(p))).argmax(-1)
    counts = torch.bincount(draws, minlength=len(p)).double()
    kept = p > 0
    assert counts[~kept].sum() == 0   # a token the filters dropped is never drawn
    expected = p[kept].double() * len(keys)
    stat = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, (p_value, counts.tolist(), expected.tolist())


def test_the_noise_is_finite_and_positive_at_both_ends_of_the_hash():
    """E = 0 at the largest hash would make a masked token's 0 / E a NaN, which argmax picks: a token outside
    the grammar."""
    e = exponential(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all()), e.tolist()
    p = torch.tensor([0.0, 1.0, 0.0])   # a grammar allows only token 1
    assert int((p / exponential(torch.tensor([2**32 - 1, 7, 2**32 - 1]))).argmax()) == 1


def test_logprobs_of_a_batch_are_each_rows_own():
    rows = rows_for(len(PARAMS), 3)
    seqs = make_seqs(PARAMS, 2, rows)
    tokens, tops = sample_step(seqs, rows, constraint_rows(seqs))
    for seq, row, token, top in zip(seqs, rows, tokens, tops):
        n = seq.params.logprobs
        assert top == (None if n is None else top_logprobs(row, token, n))
    assert list(tops[2])[:3] == torch.log_softmax(rows[2], -1).topk(3).indices.tolist()


def test_penalties_of_a_batch_stay_in_their_rows():
    rows = rows_for(len(PARAMS), 2)
    seqs = make_seqs(PARAMS, 6, rows)
    logits = torch.stack(rows)
    together = penalise_rows(logits.clone(), PARAMS, [s.prompt_ids for s in seqs], [s.output_ids for s in seqs])
    alone = [apply_penalties(r.clone(), s.params, s.prompt_ids, s.output_ids) for r, s in zip(rows, seqs)]
    assert torch.equal(together, torch.stack(alone))
    assert not torch.equal(together, logits)


def test_constraints_of_a_batch_stay_in_their_rows():
    """logit_bias, a grammar mask, min_tokens' ban (kept off when the grammar then allows nothing) and a forced
    token, in rows of one batch, each as the row alone gets it."""
    def bitmask(allowed: list[int]) -> torch.Tensor:
        words = torch.zeros((V + 31) // 32, dtype=torch.int64)
        for t in allowed:
            words[t // 32] |= 1 << (t % 32)
        return words.to(torch.int32)   # (bit 31 wraps to the sign bit, as llguidance's int32 words hold it)

    none = (torch.tensor([], dtype=torch.long), torch.tensor([]))
    cases = [RowConstraint(torch.tensor([3, 9]), torch.tensor([5.0, -5.0]), None, None, None),
             RowConstraint(*none, bitmask([1, 40, 41, 299]), None, None),
             RowConstraint(*none, None, torch.tensor([EOS, 8]), None),
             RowConstraint(*none, bitmask([EOS]), torch.tensor([EOS]), None),   # the grammar allows only EOS
             RowConstraint(*none, None, None, 17),
             None]
    logits = torch.stack(rows_for(len(cases), 5))
    alone = [apply_constraints(row[None].clone(), [c])[0] for row, c in zip(logits, cases)]
    together = apply_constraints(logits.clone(), cases)
    assert torch.equal(together, torch.stack(alone))
    assert together[1].isfinite().nonzero().flatten().tolist() == [1, 40, 41, 299]
    assert together[3].isfinite().nonzero().flatten().tolist() == [EOS]
    assert together[4].isfinite().nonzero().flatten().tolist() == [17]
    assert torch.equal(together[5], logits[5])


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [0, 9])
def test_a_batch_on_the_gpu_draws_the_cpus_tokens(outputs):
    """The race's noise is integer hashing, the same on any device: a batch sampled from CUDA logits gives the
    tokens the CPU gives (random logits: no near-ties for float rounding to flip)."""
    rows = rows_for(len(PARAMS), outputs)
    seqs = make_seqs(PARAMS, outputs, rows)
    on_cpu = sample_step(seqs, rows, constraint_rows(seqs))
    on_gpu = sample_step(seqs, [r.cuda() for r in rows], constraint_rows(seqs))
    assert on_gpu[0] == on_cpu[0]
