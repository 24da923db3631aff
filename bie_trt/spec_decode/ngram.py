"""Prompt lookup: propose the tokens that followed the last n-gram the previous time it occurred.

Copying, quoting, rewriting and editing given text repeat long spans of the prompt; there the
continuation of an earlier occurrence is a good guess, and finding it costs no model and no device
memory.
"""
from __future__ import annotations

from typing import Hashable, Sequence as Seq

import numpy as np

from ..config import SpeculativeConfig
from .proposer import Proposal, ProposalRequest


def ngram_lookup(tokens: Seq[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` of length max_n .. min_n; [] when no such suffix occurred before."""
    if num_tokens <= 0 or len(tokens) <= min_n:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        # every window of n tokens that ends before the last token, compared with the suffix at once
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n   # the latest occurrence: the nearest context, and in a loop the live one
            return ids[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    """Deterministic proposals (one-hot q) from each request's own prompt and output."""

    def __init__(self, config: SpeculativeConfig):
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, requests: Seq[ProposalRequest]) -> list[Proposal]:
        return [Proposal(ngram_lookup(r.prompt_ids + r.output_ids, r.num_tokens, self.max_n, self.min_n))
                for r in requests]

    def free(self, key: Hashable) -> None:
        """Nothing is kept per sequence."""
