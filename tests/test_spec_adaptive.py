"""Adaptive γ (spec_decode/adaptive.py): the expected tokens of a step, acceptance by position, the step
costs kept relative to plain decoding (robust to stalls, a width's own cost where measured), and the choice:
speculation where it pays, plain decoding with probes where it does not, and back when a request turns
quotable; a lookup's γ chosen over what it found."""
from __future__ import annotations

import math
import time

import pytest

from bie_trt.spec_decode.adaptive import (CLIP, ENGINE_DECAY, FIRST_PROBE, LAST_PROBE, LINE_WEIGHT, MEASURE_SAMPLES,
                                          PRIOR_WEIGHT, PROBE_BUDGET, WINDOW, Acceptance, AdaptiveGamma, StepCosts,
                                          Timings, expected_tokens, step_clock)


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
    rates = a.rates()
    assert rates[0] == pytest.approx((2 + PRIOR_WEIGHT * 0.5) / (2 + PRIOR_WEIGHT))
    assert rates[2] == rates[3] == rates[1]   # no evidence: each leans on the position before
    # a request's counts lean on the engine's rate at each position instead
    assert a.rates([0.5, 0.9, 0.9, 0.8])[2:] == [0.9, 0.8]
    assert a.rates([0.5, 0.9, 0.9, 0.8])[1] == pytest.approx((1 + PRIOR_WEIGHT * 0.9) / (2 + PRIOR_WEIGHT))


def test_timings_leave_out_the_cold_first_cut_stalls_and_forget():
    t = Timings()
    t.add(50.0, 0, 0.0)          # the first run (allocations, kernel choice): left out
    assert t.samples == 0
    t.add(1.0, 0, 0.0)
    t.add(1.0, 0, 0.0)
    t.add(10.0, 0, 0.0)          # a stall counts CLIP above the fastest, not ten times the step
    assert math.exp(t.level(0.0)) == pytest.approx(math.exp(CLIP / 3))
    for _ in range(WINDOW):      # a window of ordinary steps forgets it
        t.add(1.0, 0, 0.0)
    assert t.level(0.0) == pytest.approx(0.0, abs=1e-12) and t.samples == WINDOW
    for _ in range(WINDOW):      # a lasting doubling is followed once the window has turned over
        t.add(2.0, 0, 0.0)
    assert math.exp(t.level(0.0)) == pytest.approx(2.0)
    t.add(2.0 * math.exp(0.002 * 100), 100, 0.002)   # a longer context: dearer by the slope, not a stall
    assert t.level(0.002) == pytest.approx(math.log(2.0)) and t.level(0.0) > math.log(2.0)
    first = Timings()
    for seconds in (50.0, 10.0, 1.0):   # cold, then a stall as the first kept timing: cut by the next
        first.add(seconds, 0, 0.0)
    assert first.level(0.0) == pytest.approx(CLIP / 2)


def timed(costs: StepCosts, rows: int, per_plain: float, contexts: list[int], slope: float = 0.0) -> None:
    """`rows`-row steps at each context, each `per_plain` x a plain step of 10 ms at an empty context, dearer by
    exp(slope·context)."""
    for c in contexts:
        costs.record_target(rows, 0.010 * per_plain * math.exp(slope * c), c)


def test_step_costs_are_relative_to_plain_decoding_on_one_line_and_a_widths_own():
    c = StepCosts(gamma_max=5, per_token=True)
    timed(c, 4, 1.5, [0, 0])         # before any plain step: nothing to be relative to
    c.record_proposal(0.005)
    assert not c.target[3].samples and not c.proposal.samples
    timed(c, 1, 1.0, [0, 0, 0])      # the first is cold
    timed(c, 3, 1.5, [0, 0])         # each width's first run is cold: out of its figure and of the line
    assert c.row_slope == pytest.approx(0.25) and c.target[2].samples == 1
    assert c.line(2) == pytest.approx(1.25) and c.line(6) == pytest.approx(2.25)
    # a width measured once: its own 1.5, weighed against the line's 1.5 there
    assert c.ratio(3) == pytest.approx(1.5) and c.ratio(2) == pytest.approx(1.25)
    timed(c, 6, 2.5, [0, 0])         # 0.3 a row: the line is fitted to both, each weighed by its timings
    assert c.row_slope == pytest.approx((2 * 0.5 + 5 * 1.5) / (4 + 25))
    # a device whose narrow verifies cost more than the line says (a CPU's matrix products over 2-3 rows)
    for _ in range(4 * WINDOW):   # a third dearer than it was: more than CLIP, followed a little a timing
        timed(c, 3, 2.0, [0])
        timed(c, 6, 2.5, [0])
    own = (WINDOW * 2.0 + LINE_WEIGHT * c.line(3)) / (WINDOW + LINE_WEIGHT)
    assert c.ratio(3) > c.line(3) + 0.2 and c.ratio(3) == pytest.approx(own)
    c.record_proposal(0.090)         # cold
    c.record_proposal(0.005)         # a draft step: half a plain step
    assert c.plain_seconds == pytest.approx(0.010) and c.proposal_ratio == pytest.approx(0.5)
    assert c.step_seconds(2) == pytest.approx(0.010 * (2 * 0.5 + c.ratio(3)))
    lookups = StepCosts(gamma_max=5, per_token=False)
    timed(lookups, 1, 1.0, [0, 0, 0])
    lookups.record_proposal(0.005)
    lookups.record_proposal(0.005)
    assert lookups.step_seconds(2) == pytest.approx(0.010 * lookups.ratio(3))   # made before the choice: sunk
    assert c.to_dict()["verify_ms"] == {"3": pytest.approx(10 * c.ratio(3), abs=1e-3),
                                        "6": pytest.approx(10 * c.ratio(6), abs=1e-3)}
    assert c.ratio(6) == pytest.approx(2.5, rel=0.01)   # a width timed a window's worth: its own figure, nearly
    timed(c, 4, 0.7, [0, 0, 0])   # noise below a plain step: a verify does all a plain step does, and more
    assert c.ratio(4) >= 1.0 and c.ratio(4) == pytest.approx((2 * 1.0 + LINE_WEIGHT * c.line(4)) / (2 + LINE_WEIGHT))
    # a host twice as busy, seen by plain steps only (the request decodes plainly): the verify and draft
    # figures timed before it are still in plain steps of their time, so the choice stays where it was
    before = [c.step_seconds(g) / c.step_seconds(0) for g in range(6)]
    timed(c, 1, 2.0, [0] * WINDOW)
    assert c.plain_seconds == pytest.approx(0.020)
    assert [c.step_seconds(g) / c.step_seconds(0) for g in range(6)] == pytest.approx(before)


def test_a_verify_is_compared_with_a_plain_step_at_the_same_context():
    """A prose request decodes plainly at a short context, a quoting one verifies 6 rows at a long one (the
    costs of SmolLM2 on this CPU: about +40 % a thousand tokens). Each window holds one request's steps,
    contexts a few tokens apart, so the slope comes from the longer memory: within a couple of hundred steps
    the verify reads 1.5 plain steps, not 1.5 x the longer context's cost, and the plain step's seconds
    are read at the latest context."""
    slope = math.log(1.4) / 1000
    c = StepCosts(gamma_max=5, per_token=False)
    for i in range(200):
        timed(c, 1, 1.0, [100 + i], slope)
        timed(c, 6, 1.5, [1500 + 5 * i], slope)
    assert c.ratio(6) == pytest.approx(1.5, rel=0.02)
    assert c.to_dict()["cost_per_1k_context"] == pytest.approx(0.4, abs=0.02)
    assert c.plain_seconds == pytest.approx(0.010 * math.exp(slope * c.context), rel=0.02)
    # one request alone (contexts a token apart, a timing's noise 5 %): the slope leans on 0, not on noise
    alone = StepCosts(gamma_max=5, per_token=False)
    for i in range(WINDOW + 1):
        alone.record_target(1, 0.010 * (1 + 0.05 * (i % 2)), 100 + i)
    assert alone.context_slope < 1e-4


def test_steps_are_timed_in_cpu_seconds_on_a_cpu_and_wall_seconds_on_a_gpu():
    assert step_clock("cpu") is time.process_time and step_clock("cuda") is time.perf_counter


def controller(verify_ratio: float, draft_ratio: float, gamma_max: int = 4) -> AdaptiveGamma:
    """A draft-model controller past its measuring steps: plain 10 ms, verify `verify_ratio` x that at every
    width, a draft step `draft_ratio` x."""
    g = AdaptiveGamma(gamma_max, per_token=True)
    for _ in range(MEASURE_SAMPLES + 1):   # the first timings are cold
        g.record_step([1], 0.010)
    for _ in range(MEASURE_SAMPLES + 1):
        g.record_step([gamma_max + 1], 0.010 * verify_ratio)
        g.record_proposal(0.010 * draft_ratio, 1, 1)
    return g


def test_costs_are_measured_first_plain_then_speculating():
    g = AdaptiveGamma(4, per_token=False)
    assert g.room("r") == 4 and g.take("r", 0) == 0   # a lookup looks up all it may; found nothing: plain
    assert [g.decide("r").reason for _ in range(2)] == ["measure", "measure"]
    assert g.take("r", 3) == 0
    for _ in range(MEASURE_SAMPLES + 1):
        g.record_step([1], 0.01)
        g.record_proposal(0.0001, 1, 1)
    assert g.take("r", 3) == 3 and g.decide("r").reason == "measure"   # what it found, whatever it is
    for _ in range(MEASURE_SAMPLES + 1):
        g.record_step([3], 0.02)   # lookup found 2 tokens: any width with proposals will do
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
    for _ in range(MEASURE_SAMPLES + 1):   # the first timings are cold
        g.record_step([1], 0.010)
    for _ in range(MEASURE_SAMPLES + 1):
        g.record_step([5], 0.010 * verify_ratio)
        g.record_proposal(0.0, 1, 1)
    return g


def test_speculation_that_does_not_pay_steps_aside_and_probes_ever_less_often():
    """Lookup on prose: every proposal rejected, so plain decoding, probing after 8, 16, 32 ... plain steps."""
    g = ngram_controller(verify_ratio=1.3)
    for _ in range(4):
        g.record_verify("prose", 4, 0)
    choices = [g.take("prose", 4) for _ in range(8 + 16 + 32)]
    probes = [i for i, c in enumerate(choices) if c > 0]
    assert probes == [FIRST_PROBE - 1, FIRST_PROBE + 2 * FIRST_PROBE - 1, FIRST_PROBE * 7 - 1]
    assert g.probes == 3 and g.requests["prose"].probe_after == 8 * FIRST_PROBE
    for _ in range(2000):
        g.take("prose", 4)
    assert g.requests["prose"].probe_after == LAST_PROBE


def test_a_draft_as_costly_as_the_target_never_probes_and_dear_probes_are_spaced():
    g = controller(verify_ratio=1.1, draft_ratio=1.0)   # itself as its draft: no acceptance could pay
    g.record_verify("self", 4, 4)
    assert [g.room("self") for _ in range(300)] == [0] * 300 and g.probes == 0
    g = controller(verify_ratio=1.1, draft_ratio=0.3)   # would pay if accepted; a probe costs ~0.6 plain steps
    for _ in range(4):
        g.record_verify("prose", 4, 0)
    probes = [i for i in range(200) if g.room("prose") > 0]
    assert len(probes) >= 2 and min(b - a for a, b in zip([-1] + probes, probes)) >= 0.6 / PROBE_BUDGET


def test_a_request_that_turns_quotable_gets_speculation_back():
    """N-gram lookup (cheap proposals): prose rejects, so plain decoding; a probe that is accepted brings
    speculation back, and its length grows as the later positions are accepted too."""
    g = ngram_controller(verify_ratio=1.3)
    for _ in range(4):
        g.record_verify("r", 4, 0)
    assert g.take("r", 4) == 0
    gammas = []
    for _ in range(40):   # from now on every proposal is accepted
        gamma = g.take("r", 4)
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
    assert g.room("new") == 0   # the engine's rate at position 1 is low: the newcomer starts plain
    g.record_decode("new", 0)
    assert g.explain("new")["steps_by_gamma"] == {"0": 1} and g.stats()["steps_by_gamma"][0] == 1
    g.free("new")
    g.record_decode("new", 0)    # a step recorded after the request went keeps nothing for it
    assert "new" not in g.requests and g.explain("new") is None


def test_a_lookup_verifies_what_it_found_and_one_rejection_after_a_good_run_keeps_it_long():
    """Lookup on a quoting request: the choice is among the tokens found (steps finding none are plain steps,
    not choices); a rejection after a run of accepted proposals leaves the full length, and so does a fresh
    request's first rejection where the engine's later positions are mostly accepted."""
    g = ngram_controller(verify_ratio=1.3)
    for _ in range(10):
        g.record_verify("quote", 4, 4)
    assert g.room("quote") == 4 and [g.take("quote", n) for n in (0, 2, 4)] == [0, 2, 4]
    assert g.requests["quote"].last.gamma == 4   # the lookup that found none decided nothing
    g.record_verify("quote", 4, 0)
    assert g.take("quote", 4) == 4
    g.record_verify("edit", 4, 0)   # a new request, wrong at its first proposal
    assert g.take("edit", 4) == 4


def test_a_lookups_unverified_proposal_is_judged_by_the_targets_own_token():
    """A lookup found more than adaptive γ verified: the first proposal left is judged by the token the target
    drew in its place (a verify accepts a proposal d with probability p(d), the chance the target draws d),
    only where every verified proposal was accepted; the emitted tokens in the trace are what was verified."""
    g = ngram_controller(verify_ratio=1.3)
    g.trace = []
    g.record_verify("q", 2, 2, next_accepted=True)     # positions 1, 2 verified, 3 judged: accepted
    assert (g.requests["q"].acceptance.tried, g.requests["q"].acceptance.accepted) == ([1, 1, 1, 0], [1, 1, 1, 0])
    g.record_verify("r", 2, 2, next_accepted=False)    # judged: rejected
    assert (g.requests["r"].acceptance.tried, g.requests["r"].acceptance.accepted) == ([1, 1, 1, 0], [1, 1, 0, 0])
    g.record_verify("s", 2, 1, next_accepted=True)     # position 2 rejected: position 3 was never reached
    assert (g.requests["s"].acceptance.tried, g.requests["s"].acceptance.accepted) == ([1, 1, 0, 0], [1, 0, 0, 0])
    g.record_unverified("t", True)                      # a plain step (γ = 0) judged the first proposal
    assert (g.requests["t"].acceptance.tried, g.requests["t"].acceptance.accepted) == ([1, 0, 0, 0], [1, 0, 0, 0])
    assert g.trace == [3, 3, 2] and g.engine.tried[0] == pytest.approx(sum(ENGINE_DECAY ** k for k in range(4)))
