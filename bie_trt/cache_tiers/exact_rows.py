"""Which KV blocks a row reads quantised: exactly those plain one-token-at-a-time decoding had quantised
when it reached the row's position, whatever the row is (a decode, a verify row, a prefill chunk's row,
a recompute after a prefix hit or a preemption). Pure arithmetic; the block manager makes the views.

Plain decoding computes position p after compacting at p cached tokens, so row p reads block b
(past the sink blocks) quantised iff b < (p - window) // block_size. A step's rows of one sequence
are cut into runs over which that bound is constant; each run gets its own block table.
"""
from __future__ import annotations

import torch

from ..config import KVCacheConfig

Run = tuple[int, int, int]   # (first row, rows, quantised end): blocks [sink blocks, end) read quantised


def sink_blocks(kv: KVCacheConfig) -> int:
    """Blocks holding sink tokens: always read in FP16."""
    return -(-kv.sink_tokens // kv.block_size)


def quantised_end(pos: int, kv: KVCacheConfig) -> int:
    """The row at `pos` reads blocks [sink_blocks, quantised_end) quantised, the rest in FP16."""
    return max(sink_blocks(kv), (pos - kv.window) // kv.block_size)


def runs(start: int, num_rows: int, kv: KVCacheConfig) -> list[Run]:
    """Rows start..start+num_rows-1 cut where the quantised end changes (at positions p with
    (p - window) % block_size == 0, once past the sinks): one run for an FP16-only cache."""
    if kv.dtype == "fp16":
        return [(0, num_rows, 0)]
    out, row = [], 0
    while row < num_rows:
        end = quantised_end(start + row, kv)
        next_change = kv.window + (end + 1) * kv.block_size   # the first position with a larger end
        rows = min(num_rows - row, next_change - (start + row))
        out.append((row, rows, end))
        row += rows
    return out


def join_runs(logits: list[torch.Tensor], counts: list[int], all_logits: list[bool]) -> list[torch.Tensor]:
    """The forward's logits per run -> per sequence: every row's [T, V] when all_logits, else the
    last run's last row [V]. `counts` is how many runs each sequence was cut into."""
    out, i = [], 0
    for n, every in zip(counts, all_logits):
        parts = logits[i:i + n]
        out.append((torch.cat(parts) if n > 1 else parts[0]) if every else parts[-1])
        i += n
    return out
