"""What the engine asks of a proposer (n-gram lookup or a draft model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import torch

from ..executor.sequence import Sequence


@dataclass
class Proposal:
    """Up to γ tokens guessed to follow a sequence's tokens."""

    token_ids: list[int]
    # [len(token_ids), vocab]: the (processed) draft distribution q each token was drawn from, zero
    # outside the draft's vocabulary. None: proposed deterministically (q is one-hot on the token).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        """At most num_tokens[i] tokens to follow seqs[i].token_ids. A proposer with state (a draft
        cache) compares what it saw with seq.token_ids itself: rejected guesses are simply not there."""

    def free(self, seq: Sequence) -> None:
        """seq finished, was aborted or preempted: drop whatever is kept for it."""
