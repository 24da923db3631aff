"""Choosing each request's proposal length γ every step, from what speculation buys it and what it costs.

A request's recent acceptance, by position: of the proposals at position i that were verified with
every proposal before them accepted, the share accepted (counts decayed each verify, so recent
steps weigh most; a position with little evidence leans on the engine's own rate at that position:
a request whose first proposal was just rejected has said nothing yet about the later ones, which,
once the first is right, are mostly right too). With those rates a_1, a_2, ..., a step proposing γ
tokens emits on average

    E(γ) = 1 + a_1 + a_1·a_2 + ... + a_1···a_γ   tokens,

and costs T(γ) = proposing γ tokens (γ draft steps, or one n-gram lookup) + the target's step over
γ + 1 rows; γ = 0 is a plain decode, T(0) the target's one-row step. The costs are figures the engine
measures on its own steps, whatever the device (`StepCosts`): the latest timings of each kind of step,
each compared with a plain step at the same context (a step attending to a longer context costs more,
whatever its rows). Each step takes the γ in 0..γ_max with the highest E(γ) / T(γ) tokens a second.

A draft model pays for every proposal, so its γ is chosen before it drafts (`room`). A lookup costs
next to nothing and proposes only what it matched, so it always looks up γ_max and the choice is made
after it, over what it found (`take`): verifying k of them costs only the wider verify, and a step
where nothing matched is a plain step whatever was chosen.

At γ = 0 a request learns nothing about its acceptance, so every so often (8 plain steps, doubling
while probes change nothing, up to 256) it proposes one token as a probe: a request that turns
quotable gets speculation back. A probe costs what proposing one token and verifying two rows cost
beyond a plain step (for a draft, one more draft step: it catches up on the tokens it missed); the
probes are spaced so that they take at most 2 % of the plain steps' time, and there are none where
speculation would not pay even if every proposal were accepted (a draft as costly as the target).
Figures not measured yet are measured first: the plain step, then a step with proposals (γ_max), a
couple of times each; other row counts are read off the line through the measured ones until they
are measured themselves.

Timings are noisy one way only: a step is slowed by whatever else the host or device runs, never sped
up. So the first timing of each kind is left out (its first run allocates and picks kernels), and a
timing far above its kind's fit counts only a little above it: a stall moves a figure by little, and a
lasting slow-down (a busier device) still moves it, a little each step, and fully once the window has
turned over.

The choice is only of how many tokens are proposed: verification and rejection sampling are as
exact at any γ as at a fixed one.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

DECAY = 0.8            # a request's counts shrink by this each verify: recent steps weigh most
ENGINE_DECAY = 0.98    # the engine-wide rates (a new request's prior) follow all requests, slowly
PRIOR_WEIGHT = 2.0     # how many verifies' worth of evidence the prior of a position is worth
WINDOW = 16            # the latest timings of a kind of step its figure stands on (older ones are forgotten)
CLIP = 0.15            # a timing more than this (in log seconds: +16 %) above the fastest counts as this much
SLOPE_MEMORY = 256     # the timings (fading) a kind's share of the context slope stands on
CONTEXT_RIDGE = 4e4    # tokens² of context spread: the context slope leans on 0 until the contexts timed spread wide
LINE_WEIGHT = 2.0      # timings' worth of the line in the cost of a verify at one width
MEASURE_SAMPLES = 2    # steps timed before a figure is trusted
FIRST_PROBE = 8        # plain steps before the first probe; doubled while probes change nothing
LAST_PROBE = 256
PROBE_GAMMA = 1
PROBE_BUDGET = 0.02    # the most of the plain steps' time probes may take


def step_clock(device_type: str) -> Callable[[], float]:
    """What steps are timed by: on a CPU the process's CPU seconds (the work done, whatever else a shared host
    runs: time spent descheduled is no cost of the step), elsewhere wall seconds (the host waits on the device)."""
    return time.process_time if device_type == "cpu" else time.perf_counter


class Timings:
    """The latest WINDOW timings of one kind of step, as (log seconds less a reference, tokens of context). The
    plain step's reference is 0 and its values are brought to an empty context by the slope as they are
    read (`level(slope)`); every other kind's reference is the plain step at the same context when the
    timing came, so its values are already ratios (`level(0.0)`): a device slowed for everyone (a
    shared host, a throttled GPU) leaves a figure timed before the slow-down, and not since, as true as
    one timed after it.

    Noise only ever adds time, so the first timing is left out (its run allocates and picks kernels) and
    the level is the mean of the window's values each cut to CLIP above the lowest: a stall moves it by
    CLIP / n of n timings, and a lasting slow-down is followed fully once the window has turned over.
    The context slope needs contexts that differ within a kind, which one window (16 steps of one
    request: 16 to 100 tokens apart) seldom holds, so each kind also keeps its raw timings' sums over a
    longer memory (SLOPE_MEMORY timings, fading), each cut as it came."""

    def __init__(self) -> None:
        self.window: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.cold = True
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)   # fading: weight, Σc, Σy, Σc², Σcy of log seconds
        self._level: tuple[float, float] | None = None   # (slope, level) last read, until the next timing

    @property
    def samples(self) -> int:
        return len(self.window)

    def add(self, seconds: float, context: float, slope: float, reference: float = 0.0) -> None:
        """A timing at `context`, less `reference` (log seconds); `slope`: what brings the values to one context."""
        if self.cold:
            self.cold = False
            return
        v = math.log(max(seconds, 1e-9)) - reference
        cut = min(v, min(u - slope * c for u, c in self.window) + slope * context + CLIP) if self.window else v
        self.window.append((v, context))
        self._level = None
        fade, y = 1 - 1 / SLOPE_MEMORY, cut + reference
        w, sc, sy, scc, scy = (fade * x for x in self._sums)
        self._sums = (w + 1, sc + context, sy + y, scc + context * context, scy + context * y)

    def level(self, slope: float) -> float:
        """The window's mean value, each cut to CLIP above the lowest, brought to an empty context (read every
        step for every kind, so kept until the window or the slope changes)."""
        if self._level is None or self._level[0] != slope:
            at_zero = [v - slope * c for v, c in self.window]
            ceiling = min(at_zero) + CLIP
            self._level = slope, sum(min(v, ceiling) for v in at_zero) / len(at_zero)
        return self._level[1]

    def spread(self) -> tuple[float, float]:
        """(Σ(c - c̄)², Σ(c - c̄)(y - ȳ)) of the raw log seconds over the longer memory: this kind's share of the
        pooled context slope."""
        w, sc, sy, scc, scy = self._sums
        return scc - sc * sc / w, scy - sc * sy / w


class Acceptance:
    """Decayed counts, by position, of proposals verified with all before them accepted, and accepted."""

    def __init__(self, gamma_max: int, decay: float) -> None:
        self.tried = [0.0] * gamma_max
        self.accepted = [0.0] * gamma_max
        self.decay = decay

    def record(self, proposed: int, accepted: int) -> None:
        self.tried = [t * self.decay for t in self.tried]
        self.accepted = [a * self.decay for a in self.accepted]
        for i in range(min(accepted + 1, proposed)):
            self.tried[i] += 1
            self.accepted[i] += i < accepted

    def rates(self, priors: list[float] | None = None) -> list[float]:
        """a_i by position, each count shrunk towards its prior: `priors[i]` (a request's: the engine's rate at
        that position), else the rate of the position before (the first's: 0.5)."""
        out, prior = [], 0.5
        for i, (tried, accepted) in enumerate(zip(self.tried, self.accepted)):
            prior = (accepted + PRIOR_WEIGHT * (prior if priors is None else priors[i])) / (tried + PRIOR_WEIGHT)
            out.append(prior)
        return out


def expected_tokens(rates: list[float], gamma: int) -> float:
    """Tokens a step proposing `gamma` emits on average: the accepted run, then the target's own token."""
    total, run = 1.0, 1.0
    for a in rates[:gamma]:
        run *= a
        total += run
    return total


class StepCosts:
    """Per sequence of a step: the target's plain decode step (r = 1 row a sequence), its step at each
    r = γ + 1 rows, and proposing (a draft step: a draft model proposes one token a step; or one lookup: the
    n-gram proposer proposes them all at once), each a window of timings (`Timings`). Only steps of decodes that
    all carried the same number of rows are timed (a prompt chunk or mixed lengths would say nothing about
    one r).

    A step's cost grows with the context it attends to, so every timing is compared with a plain step at the
    same context, as the plain step stood when it came: log seconds = level + slope·context, the slope
    fitted over all the target's kinds together (each about its own mean: a quoting request verifies 6
    rows at a long context, a prose request decodes plainly at a short one, and that must not read as a
    dearer verify). A verify's cost is then the mean of its timings' ratios, and the plain step's own
    seconds are read at the latest context.

    The verify at r rows is its own figure shrunk towards one line, 1 + slope·(r - 1) plain steps, fitted by
    least squares through the plain step to the widths timed, each weighed by its timings: a width timed a
    few times stands on a few timings, and one never timed is read off the line; the cost need not be
    linear in r (on a CPU a product over 2 or 3 rows can cost more than over 6), which a width's own figure
    shows once it has been timed."""

    def __init__(self, gamma_max: int, per_token: bool) -> None:
        self.target = [Timings() for _ in range(gamma_max + 1)]   # r = 1 .. gamma_max + 1 rows
        self.proposal = Timings()
        self.per_token = per_token
        self.context = 0.0          # the latest step's, where the plain step's seconds are read
        self.context_slope = 0.0    # d log(seconds) / d token of context
        self.row_slope = 0.0        # the line's cost of a row past the first, in plain steps
        self._ratios = [1.0] * (gamma_max + 1)   # T(r) / T(1), r = 1 ..
        self.plain_seconds = 0.0    # at the latest context
        self.proposal_ratio = 0.0   # a draft step or a lookup, in plain steps at the same context

    @property
    def plain(self) -> Timings:
        return self.target[0]

    def record_target(self, rows: int, seconds: float, context: float = 0.0) -> None:
        if rows == 1:
            self.plain.add(seconds, context, self.context_slope)
        elif self.plain.samples:   # (before the plain step is timed, nothing to be relative to)
            self.target[rows - 1].add(seconds, context, 0.0, self._plain_at(context))
        self.context = context
        self._refit()

    def record_proposal(self, seconds: float, context: float = 0.0) -> None:
        if self.plain.samples:
            self.proposal.add(seconds, context, 0.0, self._plain_at(context))
            self._price()

    def _plain_at(self, context: float) -> float:
        """The plain step's log seconds at `context`."""
        return self.plain.level(self.context_slope) + self.context_slope * context

    def _refit(self) -> None:
        spreads = [t.spread() for t in self.target if t.samples]
        self.context_slope = max(0.0, sum(cy for _, cy in spreads) / (sum(cc for cc, _ in spreads) + CONTEXT_RIDGE))
        # a verify computes all a plain step does and more: noise must not make it look cheaper
        own = [1.0] + [max(1.0, math.exp(t.level(0.0))) if t.samples else 0.0 for t in self.target[1:]]
        fit = [(t.samples * (r - 1) * (own[r - 1] - 1), t.samples * (r - 1) ** 2)
               for r, t in enumerate(self.target[1:], 2) if t.samples]
        self.row_slope = max(0.0, sum(a for a, _ in fit) / sum(b for _, b in fit)) if fit else 0.0
        self._ratios = [1.0] + [(t.samples * own[r - 1] + LINE_WEIGHT * self.line(r)) / (t.samples + LINE_WEIGHT)
                                for r, t in enumerate(self.target[1:], 2)]
        self._price()

    def measured(self, rows: int) -> bool:
        return self.target[rows - 1].samples >= MEASURE_SAMPLES

    def ratio(self, rows: int) -> float:
        """T(rows) / T(1) at the same context: the width's own figure, shrunk towards the line by LINE_WEIGHT
        timings' worth."""
        return self._ratios[rows - 1]

    def line(self, rows: int) -> float:
        return 1.0 + self.row_slope * (rows - 1)

    def _price(self) -> None:
        """The plain step's seconds at the latest context, and proposing (a draft step, a lookup) in plain steps
        (0.0 each until timed)."""
        if self.plain.samples:
            self.plain_seconds = math.exp(self._plain_at(self.context))
        if self.proposal.samples:
            self.proposal_ratio = math.exp(self.proposal.level(0.0))

    def step_seconds(self, gamma: int) -> float:
        """A step verifying `gamma` proposals: drafting them (a lookup has been made by the time its proposals are
        chosen: nothing more to pay), then the target over gamma + 1 rows."""
        proposing = self.proposal_ratio * gamma if self.per_token else 0.0
        return self.plain_seconds * (proposing + self.ratio(gamma + 1))

    def to_dict(self) -> dict:
        ms = 1e3 * self.plain_seconds
        return {"plain_ms": round(ms, 3), "context": round(self.context),
                "verify_ms": {str(r): round(ms * self.ratio(r), 3)
                              for r, t in enumerate(self.target[1:], 2) if t.samples},
                "verify_row_ms": round(ms * self.row_slope, 3),
                "cost_per_1k_context": round(math.exp(1000 * self.context_slope) - 1, 4),
                ("draft_step_ms" if self.per_token else "lookup_ms"): round(ms * self.proposal_ratio, 3)}


@dataclass
class Decision:
    """A request's γ for one step, and why."""

    gamma: int
    reason: str                      # best | probe | measure
    acceptance: list[float]          # a_1.. the choice used
    tokens_per_s: dict[int, float]   # expected, at each γ considered

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "reason": self.reason, "acceptance": [round(a, 3) for a in self.acceptance],
                "expected_tokens_per_s": {str(g): round(v, 2) for g, v in self.tokens_per_s.items()}}


@dataclass
class _Request:
    acceptance: Acceptance
    plain_steps: int = 0
    probe_after: int = FIRST_PROBE
    last: Decision | None = None
    steps_by_gamma: dict[int, int] = field(default_factory=dict)


class AdaptiveGamma:
    """Each request's γ, step by step (see the module docstring). `room(key)` is asked once for every decode
    that may speculate (the proposals to make room for), `take(key, n)` once its n proposals are made (how
    many to verify); `record_verify`, `record_step` and `record_proposal` feed it what happened."""

    def __init__(self, gamma_max: int, per_token: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.gamma_max = gamma_max
        self.clock = clock   # what the engine times its steps by (step_clock)
        self.costs = StepCosts(gamma_max, per_token)
        self.engine = Acceptance(gamma_max, ENGINE_DECAY)
        self.requests: dict[Hashable, _Request] = {}
        self.steps_by_gamma = [0] * (gamma_max + 1)
        self.probes = 0
        # a list to log into (benchmarks): each choice [γ, reason, expected tokens], each verify's tokens after it
        self.trace: list[list] | None = None

    def _request(self, key: Hashable) -> _Request:
        if key not in self.requests:
            self.requests[key] = _Request(Acceptance(self.gamma_max, DECAY))
        return self.requests[key]

    def decide(self, key: Hashable, limit: int | None = None) -> Decision:
        """This step's γ for the request, at most `limit` (what a lookup found), and its bookkeeping: plain steps
        towards the next probe."""
        top = self.gamma_max if limit is None else min(limit, self.gamma_max)
        state = self._request(key)
        rates = state.acceptance.rates(self.engine.rates())
        rates_per_gamma = {g: expected_tokens(rates, g) / max(self.costs.step_seconds(g), 1e-9)
                           for g in range(top + 1)}
        if not self.costs.measured(1):
            decision = Decision(0, "measure", rates, rates_per_gamma)
        elif not (self.costs.proposal.samples and any(self.costs.measured(r) for r in range(2, self.gamma_max + 2))):
            decision = Decision(top, "measure", rates, rates_per_gamma)
        else:
            best = max(rates_per_gamma, key=lambda g: (rates_per_gamma[g], -g))
            decision = Decision(best, "best", rates, rates_per_gamma)
            if best > 0:   # speculation pays (again): probe soon after it stops paying
                state.plain_steps, state.probe_after = 0, FIRST_PROBE
            elif self._could_pay():
                state.plain_steps += 1
                if state.plain_steps >= max(state.probe_after, self._probe_spacing()):
                    decision = Decision(min(PROBE_GAMMA, top), "probe", rates, rates_per_gamma)
                    state.plain_steps, state.probe_after = 0, min(2 * state.probe_after, LAST_PROBE)
                    self.probes += 1
        state.last = decision
        if self.trace is not None:
            self.trace.append([decision.gamma, decision.reason, round(expected_tokens(rates, decision.gamma), 3)])
        return decision

    def _could_pay(self) -> bool:
        """Whether some γ would beat plain decoding if every proposal were accepted."""
        plain = self.costs.step_seconds(0)
        return any((g + 1) / self.costs.step_seconds(g) > 1 / plain for g in range(1, self.gamma_max + 1))

    def _probe_spacing(self) -> int:
        """Plain steps between probes for them to take at most PROBE_BUDGET of the time."""
        costs = self.costs
        extra = costs.step_seconds(min(PROBE_GAMMA, self.gamma_max)) / costs.step_seconds(0) - 1
        if costs.per_token:   # the draft first catches up on the tokens it missed: about one more step
            extra += costs.proposal_ratio
        return int(extra / PROBE_BUDGET)

    def room(self, key: Hashable) -> int:
        """The proposals to make room for this step: a draft's γ, chosen now (each costs a draft step); a lookup's
        γ_max (it proposes only what it matched; `take` chooses among those)."""
        return self.decide(key).gamma if self.costs.per_token else self.gamma_max

    def take(self, key: Hashable, proposed: int) -> int:
        """How many of the `proposed` tokens to verify: all of a draft's (chosen before drafting); of a lookup's,
        the best count over what it matched (none matched: a plain step, and nothing to decide)."""
        if self.costs.per_token or not proposed:
            return proposed
        return self.decide(key, proposed).gamma

    def record_decode(self, key: Hashable, gamma: int) -> None:
        """The step ran with `gamma` proposals for the request (fewer than decided when lookup found fewer)."""
        state = self.requests.get(key)
        if state is not None:
            state.steps_by_gamma[gamma] = state.steps_by_gamma.get(gamma, 0) + 1
        self.steps_by_gamma[gamma] += 1

    def record_verify(self, key: Hashable, proposed: int, accepted: int, next_accepted: bool | None = None) -> None:
        """A verify accepted `accepted` of the request's `proposed`; `next_accepted`: whether the proposal after
        them, found by a lookup but left unverified, matched the target's own token (None: none was left)."""
        if self.trace is not None:
            self.trace.append(accepted + 1)
        if next_accepted is not None and accepted == proposed < self.gamma_max:
            proposed, accepted = proposed + 1, accepted + next_accepted
        self._request(key).acceptance.record(proposed, accepted)
        self.engine.record(proposed, accepted)

    def record_unverified(self, key: Hashable, accepted: bool) -> None:
        """A plain step left a lookup's proposal unverified (γ = 0), and the target's own token judged it."""
        self._request(key).acceptance.record(1, int(accepted))
        self.engine.record(1, int(accepted))

    def record_step(self, rows: list[int], seconds: float, context: float = 0.0) -> None:
        """A step of decodes only, `rows` a sequence (1 + its proposals), took `seconds` on the target (its
        forward, the sampling or verification, the bookkeeping); `context`: the tokens its sequences had in the
        cache, on average."""
        if rows and len(set(rows)) == 1:
            self.costs.record_target(rows[0], seconds / len(rows), context)

    def record_proposal(self, seconds: float, sequences: int, steps: int, context: float = 0.0) -> None:
        """Proposing for `sequences` (`context` tokens each, on average) took `seconds` in `steps` draft steps (a
        lookup: steps is 1)."""
        if sequences and steps:
            self.costs.record_proposal(seconds / sequences / (steps if self.costs.per_token else 1), context)

    def free(self, key: Hashable) -> None:
        self.requests.pop(key, None)

    def explain(self, key: Hashable) -> dict | None:
        """The request's last choice and why, with its steps by γ (None before its first)."""
        state = self.requests.get(key)
        if state is None or state.last is None:
            return None
        return {**state.last.to_dict(), "steps_by_gamma": {str(g): n for g, n in sorted(state.steps_by_gamma.items())},
                "step_costs": self.costs.to_dict()}

    def stats(self) -> dict:
        return {"gamma_max": self.gamma_max, "steps_by_gamma": list(self.steps_by_gamma), "probes": self.probes,
                "acceptance": [round(a, 4) for a in self.engine.rates()], "step_costs": self.costs.to_dict()}
