"""What a proposer (n-gram lookup or a draft model) is asked, what it answers, and what it may use of
the target's runtime. Proposers see token arrays and sizes only, never the executor's sequences."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence as Seq

import torch

from ..config import KVCacheConfig, ModelConfig
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..engine_format import Manifest
    from ..logits_constraint import LogitsConstraint
    from ..model.cuda_graphs import DecodeGraphs


@dataclass
class ProposalRequest:
    """One request's turn: its tokens so far and how many proposals may follow them."""

    key: Hashable            # the same on every call for one request; `free(key)` forgets it
    prompt_ids: list[int]
    output_ids: list[int]
    num_tokens: int          # at most this many proposals
    params: SamplingParams   # the target's sampling, which a draft's proposals follow
    seed: int                # the request's seed (a draft salts its own from it)
    # What the target's sampling forbids or favours (logit_bias, min_tokens, the grammar at its current
    # state): a draft proposes under it too, and leaves the grammar where it found it.
    constraint: LogitsConstraint | None = None

    @property
    def num_total(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """(prompt + output)[start:stop] without building the whole list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(0, start - n):max(0, stop - n)]


@dataclass
class Proposal:
    """Up to num_speculative_tokens tokens guessed to follow a request's tokens."""

    token_ids: list[int]
    # [len(token_ids), vocab]: the (processed) draft distribution q each token was drawn from, zero
    # outside the draft's vocabulary. None: proposed deterministically (q is one-hot on the token).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: Seq[ProposalRequest]) -> list[Proposal]:
        """At most requests[i].num_tokens tokens to follow requests[i]'s tokens. A proposer with state (a
        draft cache) compares what it saw with the tokens itself: rejected guesses are simply not there."""

    def free(self, key: Hashable) -> None:
        """The request finished, was aborted or preempted: drop whatever is kept for it."""


class TargetRuntime(Protocol):
    """What a draft model shares with the target's runner: where it runs and the plan's sizes."""

    device: torch.device
    dtype: torch.dtype
    kv_config: KVCacheConfig
    model_config: ModelConfig      # the target's: its vocab_size is the proposals' length
    manifest: Manifest
    max_num_seqs: int
    chunked_prefill_size: int
    graphs: DecodeGraphs | None    # the target's CUDA graphs (None: eager), whose batch sizes and pool a draft shares
