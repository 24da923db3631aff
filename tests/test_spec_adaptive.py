"""Adaptive γ (spec_decode/adaptive.py): the expected tokens of a step, acceptance by position, the step
costs kept relative to plain decoding, and the choice: speculation where it pays, plain decoding with
probes where it does not, and back when a request turns quotable."""
from __future__ import annotations

import pytest

from bie_trt.spec_decode.adaptive import (FIRST_PROBE, LAST_PROBE, MEASURE_SAMPLES, PRIOR_WEIGHT, PROBE_BUDGET,
                                          Acceptance, AdaptiveGamma, StepCosts, expected_tokens)


def test_expected_tokens_of_a_step():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2   # nothing past a position that is never accepted


def test_acceptance_counts_only_positions_verified_after_accepted_ones():
    a = Acceptance(4, decay=1.0)
    a.record(4, 1)   # position 1 accepted, 2 rejected, 3 and 4 never judged
    assert (a.tried, a.accepted) == ([1, 1, 0, 0], [1, 0, 0, 0])
    a.record(2, 2)   # both accepted; the bonus token is not a proposal
    assert (a.tried, a.accepted) == ([2, 2, 0, 0], [2, 1, 0, 0])
    rates = a.rates(first_prior=0.5)
    assert rates[0] == pytest.approx((2 + PRIOR_WEIGHT * 0.5) / (2 + PRIOR_WEIGHT))
    assert rates[2] == rates[3] == rates[1]   # no evidence: each leans on the position before


def test_step_costs_are_relative_to_plain_decoding_on_one_line():
    c = StepCosts(gamma_max=5, per_token=True)
    c.record_target(4, 9.0)   # before any plain step: nothing to be relative to
    assert not c.relative[2].samples
    c.record_target(1, 2.0)
    c.record_target(3, 3.0)   # 1.5 x plain: 0.25 a row
    assert c.ratio(2) == pytest.approx(1.25) and c.ratio(6) == pytest.approx(2.25)
    c.record_target(6, 5.0)   # 2.5 x plain: 0.3 a row; the wide verify weighs most in the fit
    assert c.slope == pytest.approx((0.8 * 2 * 0.5 + 5 * 1.5) / (0.8 * 4 + 25)) and c.relative[4].value == 2.5
    c.record_proposal(1.0)    # a draft step: half a plain step
    assert c.step_seconds(0) == 2.0 and c.step_seconds(2) == pytest.approx(2.0 * (2 * 0.5 + c.ratio(3)))
    # a host twice as busy slows the plain step: every figure follows it
    before = c.step_seconds(2) / c.step_seconds(0)
    for _ in range(40):
        c.record_target(1, 4.0)
    assert c.step_seconds(2) / c.step_seconds(0) == pytest.approx(before)
    assert c.to_dict()["verify_ms"] == {"3": pytest.approx(1.5 * c.plain.value * 1e3),
                                        "6": pytest.approx(2.5 * c.plain.value * 1e3)}


def controller(verify_ratio: float, draft_ratio: float, gamma_max: int = 4) -> AdaptiveGamma:
    """A draft-model controller past its measuring steps: plain 10 ms, verify `verify_ratio` x that at every
    width, a draft step `draft_ratio` x."""
    g = AdaptiveGamma(gamma_max, per_token=True)
    for _ in range(MEASURE_SAMPLES):
        g.record_step([1], 0.010)
        g.record_step([gamma_max + 1], 0.010 * verify_ratio)
        g.record_proposal(0.010 * draft_ratio, 1, 1)
    return g


def test_costs_are_measured_first_plain_then_speculating():
    g = AdaptiveGamma(4, per_token=False)
    assert [g.decide("r").reason for _ in range(2)] == ["measure", "measure"]
    assert g.gamma("r") == 0
    g.record_step([1], 0.01)
    g.record_step([1], 0.01)
    assert g.decide("r").gamma == 4 and g.decide("r").reason == "measure"
    g.record_step([3], 0.02)   # lookup found 2 tokens: any width with proposals will do
    g.record_step([3], 0.02)
    assert g.decide("r").reason == "best"


def test_speculation_that_pays_runs_at_full_length():
    g = controller(verify_ratio=1.2, draft_ratio=0.1)
    for _ in range(5):
        g.record_verify("quote", 4, 4)
    d = g.decide("quote")
    assert (d.gamma, d.reason) == (4, "best")
    assert d.tokens_per_s[4] > d.tokens_per_s[0]


def ngram_controller(verify_ratio: float) -> AdaptiveGamma:
    """An n-gram controller past its measuring steps: plain 10 ms, verify `verify_ratio` x that, lookups free."""
    g = AdaptiveGamma(4, per_token=False)
    for _ in range(MEASURE_SAMPLES):
        g.record_step([1], 0.010)
        g.record_step([5], 0.010 * verify_ratio)
        g.record_proposal(0.0, 1, 1)
    return g


def test_speculation_that_does_not_pay_steps_aside_and_probes_ever_less_often():
    """Lookup on prose: every proposal rejected, so plain decoding, probing after 8, 16, 32 ... plain steps."""
    g = ngram_controller(verify_ratio=1.3)
    for _ in range(4):
        g.record_verify("prose", 4, 0)
    choices = [g.gamma("prose") for _ in range(8 + 16 + 32)]
    probes = [i for i, c in enumerate(choices) if c > 0]
    assert probes == [FIRST_PROBE - 1, FIRST_PROBE + 2 * FIRST_PROBE - 1, FIRST_PROBE * 7 - 1]
    assert g.probes == 3 and g.requests["prose"].probe_after == 8 * FIRST_PROBE
    for _ in range(2000):
        g.gamma("prose")
    assert g.requests["prose"].probe_after == LAST_PROBE


def test_a_draft_as_costly_as_the_target_never_probes_and_dear_probes_are_spaced():
    g = controller(verify_ratio=1.1, draft_ratio=1.0)   # itself as its draft: no acceptance could pay
    g.record_verify("self", 4, 4)
    assert [g.gamma("self") for _ in range(300)] == [0] * 300 and g.probes == 0
    g = controller(verify_ratio=1.1, draft_ratio=0.3)   # would pay if accepted; a probe costs ~0.6 plain steps
    for _ in range(4):
        g.record_verify("prose", 4, 0)
    probes = [i for i in range(200) if g.gamma("prose") > 0]
    assert len(probes) >= 2 and min(b - a for a, b in zip([-1] + probes, probes)) >= 0.6 / PROBE_BUDGET


def test_a_request_that_turns_quotable_gets_speculation_back():
    """N-gram lookup (cheap proposals): prose rejects, so plain decoding; a probe that is accepted brings
    speculation back, and its length grows as the later positions are accepted too."""
    g = ngram_controller(verify_ratio=1.3)
    for _ in range(4):
        g.record_verify("r", 4, 0)
    assert g.gamma("r") == 0
    gammas = []
    for _ in range(40):   # from now on every proposal is accepted
        gamma = g.gamma("r")
        gammas.append(gamma)
        if gamma:
            g.record_verify("r", gamma, gamma)
    first = next(i for i, x in enumerate(gammas) if x)
    assert first == FIRST_PROBE - 2 and g.decide("r").reason == "best"   # 1 plain step above, 7 here
    assert gammas[-1] == 4 and all(x == 4 for x in gammas[-10:])


def test_a_new_request_starts_from_the_engines_acceptance_and_state_is_freed():
    g = controller(verify_ratio=1.5, draft_ratio=0.05)
    for _ in range(50):
        g.record_verify("old", 4, 0)
    assert g.gamma("new") == 0   # the engine's rate at position 1 is low: the newcomer starts plain
    g.record_decode("new", 0)
    assert g.explain("new")["steps_by_gamma"] == {"0": 1} and g.stats()["steps_by_gamma"][0] == 1
    g.free("new")
    g.record_decode("new", 0)    # a step recorded after the request went keeps nothing for it
    assert "new" not in g.requests and g.explain("new") is None
