"""The engine's side of speculative decoding: which method runs, the proposals of a step (cut where a grammar
refuses), their verification and counters, adaptive γ's measurements, and what a request's speculation
leaves when its blocks go."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..spec_decode.adaptive import AdaptiveGamma
from ..spec_decode.proposer import Proposal
from ..spec_decode.rejection import verify
from ..spec_decode.select import make_proposer
from .model_runner import ModelRunner
from .sequence import Sequence


class Speculation:
    def __init__(self, runner: ModelRunner, engine_dir: Path):
        self.config = runner.settings.speculative   # the caller's, else the engine's default (resolve.py)
        self.num_tokens = self.config.num_speculative_tokens if self.config.enabled else 0
        runner.capture_verify_graphs(self.num_tokens)
        self.proposer = make_proposer(self.config, engine_dir, runner)
        # each request's γ chosen every step (None: always num_speculative_tokens)
        self.adaptive = (AdaptiveGamma(self.num_tokens, per_token=self.config.method == "draft_model")
                         if self.proposer is not None and self.config.adaptive else None)
        self.counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.accepted_by_position = [0] * self.num_tokens

    def propose(self, lookahead: dict[Sequence, int]) -> dict[Sequence, Proposal]:
        """Proposals for the decodes the scheduler kept room for, each cut where its grammar refuses a token
        (the target could never accept it: verifying it is wasted); empty ones are left out."""
        if not lookahead or self.proposer is None:
            return {}
        seqs = list(lookahead)
        start, before = time.perf_counter(), self._draft_work()
        proposals = self.proposer.propose([seq.proposal_request(lookahead[seq]) for seq in seqs])
        if self.adaptive is not None:
            self._time_proposals(len(seqs), time.perf_counter() - start, before)
        for seq, proposal in zip(seqs, proposals):
            if len(proposal.token_ids) > lookahead[seq]:
                raise RuntimeError(f"the proposer returned {len(proposal.token_ids)} tokens where "
                                   f"{lookahead[seq]} fit (a proposer bug)")
            if seq.constraint is not None and proposal.token_ids:
                keep = seq.constraint.allowed_prefix(proposal.token_ids)
                proposal.token_ids = proposal.token_ids[:keep]
                proposal.probs = None if proposal.probs is None else proposal.probs[:keep]
        return {seq: p for seq, p in zip(seqs, proposals) if p.token_ids}

    def _draft_work(self) -> tuple[int, int]:
        """The draft's forwards and the tokens it ran so far ((0, 0) for n-gram lookup)."""
        steps = getattr(self.proposer, "steps", None)
        return (sum(steps.values()), self.proposer.tokens_forwarded) if steps is not None else (0, 0)

    def _time_proposals(self, num_seqs: int, seconds: float, before: tuple[int, int]) -> None:
        """A proposal round's time, per sequence and draft step. A draft round that first caught up on many
        tokens (after plain steps) is not a draft step's cost: it is left out."""
        if self.config.method != "draft_model":
            self.adaptive.record_proposal(seconds, num_seqs, 1)
            return
        steps, fed = (now - then for now, then in zip(self._draft_work(), before))
        if fed <= num_seqs * (2 * self.config.num_speculative_tokens + 1):
            self.adaptive.record_proposal(seconds, num_seqs, steps)

    def record_decodes(self, seqs: list[Sequence], rows: list[int]) -> None:
        """A step of decodes of generated tokens only (whose time says what r rows a sequence cost): each
        sequence's γ of the step."""
        if self.adaptive is not None:
            for seq, r in zip(seqs, rows):
                self.adaptive.record_decode(seq, r - 1)

    def record_step(self, rows: list[int], seconds: float) -> None:
        if self.adaptive is not None:
            self.adaptive.record_step(rows, seconds)

    def verify(self, seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> list[int]:
        """rows [k+1, V]: the target's logits at the pending token and each of k proposals -> the tokens to
        emit, counted."""
        tokens = verify(rows, proposal, seq.params, seq.generator, seq.prompt_ids, seq.output_ids, seq.constraint)
        proposed, accepted = len(proposal.token_ids), len(tokens) - 1
        seq.num_drafts += 1
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted
        if self.adaptive is not None:
            self.adaptive.record_verify(seq, proposed, accepted)
        self.counts["num_drafts"] += 1
        self.counts["num_draft_tokens"] += proposed
        self.counts["num_accepted_tokens"] += accepted
        for i in range(accepted):
            self.accepted_by_position[i] += 1
        return tokens

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
