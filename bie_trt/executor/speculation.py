"""The engine's side of speculative decoding: which method runs, the proposals of a step (cut where a grammar
refuses), their verification and counters, adaptive γ's measurements, and what a request's speculation
leaves when its blocks go."""
from __future__ import annotations


import torch

from ..spec_decode.adaptive import AdaptiveGamma, step_clock
from ..spec_decode.proposer import Proposal
from ..spec_decode.rejection import verify
from ..spec_decode.select import make_proposer
from .model_runner import ModelRunner
from .sequence import Sequence


def context_of(seqs: list[Sequence]) -> float:
    """The tokens the sequences had in the cache before the step, on average: what its attention read."""
    return sum(seq.num_cached for seq in seqs) / len(seqs) if seqs else 0.0


class Speculation:
    def __init__(self, runner: ModelRunner):
        self.config = runner.settings.speculative   # the caller's, else the engine's default (resolve.py)
        self.num_tokens = self.config.num_speculative_tokens if self.config.enabled else 0
        runner.capture_verify_graphs(self.num_tokens)
        self.proposer = make_proposer(self.config, runner.engine_dir, runner)
        # each request's γ chosen every step (None: always num_speculative_tokens)
        self.adaptive = (AdaptiveGamma(self.num_tokens, per_token=self.config.method == "draft_model",
                                       clock=step_clock(runner.device.type))
                         if self.proposer is not None and self.config.adaptive else None)
        self.counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.accepted_by_position = [0] * self.num_tokens
        self.step_context = 0.0   # the tokens in the cache a sequence of the step being timed read, on average
        # this step's first proposal a lookup found but adaptive γ left unverified, by sequence
        self.unverified: dict[Sequence, int] = {}

    def propose(self, lookahead: dict[Sequence, int]) -> dict[Sequence, Proposal]:
        """Proposals for the decodes the scheduler kept room for, each cut where its grammar refuses a token
        (the target could never accept it: verifying it is wasted), and a lookup's to the γ adaptive γ takes
        of them; empty ones are left out."""
        self.unverified = {}
        if not lookahead or self.proposer is None:
            return {}
        seqs = list(lookahead)
        start, before = self.clock(), self._draft_work()
        proposals = self.proposer.propose([seq.proposal_request(lookahead[seq]) for seq in seqs])
        if self.adaptive is not None:
            self._time_proposals(seqs, self.clock() - start, before)
        for seq, proposal in zip(seqs, proposals):
            if len(proposal.token_ids) > lookahead[seq]:
                raise RuntimeError(f"the proposer returned {len(proposal.token_ids)} tokens where "
                                   f"{lookahead[seq]} fit (a proposer bug)")
            keep = len(proposal.token_ids)
            if seq.constraint is not None and keep:
                keep = seq.constraint.allowed_prefix(proposal.token_ids)
            if self.adaptive is not None:   # a lookup's γ is chosen over what it found
                found, keep = keep, self.adaptive.take(seq, keep)
                if keep < found:   # the first it left: the target's own token there judges it, for free
                    self.unverified[seq] = proposal.token_ids[keep]
            if keep < len(proposal.token_ids):
                proposal.token_ids = proposal.token_ids[:keep]
                proposal.probs = None if proposal.probs is None else proposal.probs[:keep]
        return {seq: p for seq, p in zip(seqs, proposals) if p.token_ids}

    def clock(self) -> float:
        """Now, by the clock adaptive γ times steps with (process CPU seconds on a CPU; 0.0 without it)."""
        return self.adaptive.clock() if self.adaptive is not None else 0.0

    def _draft_work(self) -> tuple[int, int]:
        """The draft's forwards and the tokens it ran so far ((0, 0) for n-gram lookup)."""
        steps = getattr(self.proposer, "steps", None)
        return (sum(steps.values()), self.proposer.tokens_forwarded) if steps is not None else (0, 0)

    def _time_proposals(self, seqs: list[Sequence], seconds: float, before: tuple[int, int]) -> None:
        """A proposal round's time, per sequence and draft step. A draft round that first caught up on many
        tokens (after plain steps) is not a draft step's cost: it is left out."""
        context = context_of(seqs)
        if self.config.method != "draft_model":
            self.adaptive.record_proposal(seconds, len(seqs), 1, context)
            return
        steps, fed = (now - then for now, then in zip(self._draft_work(), before))
        if fed <= len(seqs) * (2 * self.config.num_speculative_tokens + 1):
            self.adaptive.record_proposal(seconds, len(seqs), steps, context)

    def record_decodes(self, seqs: list[Sequence], rows: list[int]) -> None:
        """A step of decodes of generated tokens only (whose time says what r rows a sequence cost): each
        sequence's γ of the step, and the context it reads (before the step writes)."""
        if self.adaptive is not None:
            self.step_context = context_of(seqs)
            for seq, r in zip(seqs, rows):
                self.adaptive.record_decode(seq, r - 1)

    def record_step(self, rows: list[int], seconds: float) -> None:
        """The step of decodes `record_decodes` saw took `seconds`: a timing of its width at its context."""
        if self.adaptive is not None:
            self.adaptive.record_step(rows, seconds, self.step_context)

    def verify(self, seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> list[int]:
        """rows [k+1, V]: the target's logits at the pending token and each of k proposals -> the tokens to
        emit, counted."""
        tokens = verify(rows, proposal, seq.params, seq.generator, seq.prompt_ids, seq.output_ids, seq.constraint)
        proposed, accepted = len(proposal.token_ids), len(tokens) - 1
        seq.num_drafts += 1
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted
        if self.adaptive is not None:
            self.adaptive.record_verify(seq, proposed, accepted, self._judged(seq, tokens[-1]))
        self.counts["num_drafts"] += 1
        self.counts["num_draft_tokens"] += proposed
        self.counts["num_accepted_tokens"] += accepted
        for i in range(accepted):
            self.accepted_by_position[i] += 1
        return tokens

    def judge_unverified(self, sampled: dict[Sequence, tuple[list[int], list]]) -> None:
        """Plain steps' tokens (`sampled`: each decode's [token] and logprobs): where adaptive γ left a lookup's
        proposals unverified, the first is judged by the token the target drew in its place."""
        for seq in [seq for seq in self.unverified if seq in sampled]:
            self.adaptive.record_unverified(seq, self._judged(seq, sampled[seq][0][0]))

    def _judged(self, seq: Sequence, token: int) -> bool | None:
        """Whether the proposal adaptive γ left unverified would have been accepted where the target drew `token`
        after the verified ones (None: none was left). Verifying a proposal d accepts it with probability p(d),
        the chance that the target draws d itself: the draw is a fair judge (of a position it reached: where a
        verified proposal was rejected, `record_verify` leaves it out)."""
        proposal = self.unverified.pop(seq, None)
        return None if proposal is None else token == proposal

    def free(self, seq: Sequence) -> None:
        """The request's blocks went (finished, aborted, preempted): its draft cache and γ state go too; its last
        γ choice stays on the sequence for its output."""
        self.proposer.free(seq)
        if self.adaptive is not None:
            seq.gamma_choice = self.adaptive.explain(seq) or seq.gamma_choice
            self.adaptive.free(seq)

    def output(self, seq: Sequence) -> dict | None:
        """A request's speculation counters, and with adaptive γ its last choice and why (None: speculation off)."""
        if self.proposer is None:
            return None
        out = {"num_drafts": seq.num_drafts, "num_draft_tokens": seq.num_draft_tokens,
               "num_accepted_tokens": seq.num_accepted_tokens}
        if self.adaptive is not None:
            out["gamma"] = seq.gamma_choice or self.adaptive.explain(seq)
        return out

    def stats(self) -> dict:
        out = {**self.counts, "accepted_by_position": list(self.accepted_by_position)}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.stats()
        drawn = getattr(self.proposer, "drawn", None)
        if drawn is not None:   # the draft's proposals by where they were drawn (host: a grammar or penalties)
            out["draft_proposals"] = dict(drawn)
        return out
