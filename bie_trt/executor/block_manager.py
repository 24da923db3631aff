"""Block bookkeeping over the two pools: FP16 for sinks / recent window / chunk in flight,
quantised for everything that has left the window (DESIGN §5)."""
from __future__ import annotations

from collections import deque

from ..config import KVCacheConfig
from ..kv.pool import KVPools, decode_block, encode_quant_block
from ..kv.quant import quantize_block
from .sequence import Sequence


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the scheduler waits or preempts, never crashes."""


class BlockManager:
    def __init__(self, kv: KVCacheConfig, num_fp_blocks: int, num_quant_blocks: int):
        self.kv = kv
        self.free_fp: deque[int] = deque(range(num_fp_blocks))
        self.free_quant: deque[int] = deque(range(num_quant_blocks))
        self.quantised = kv.dtype != "fp16"

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """FP16 blocks to add so the cache can hold `num_tokens` tokens of `seq`."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_fp)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_fp):
            raise OutOfBlocks(f"need {need} KV blocks, {len(self.free_fp)} free")
        seq.block_table.extend(self.free_fp.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        for entry in seq.block_table:
            is_q, block = decode_block(entry)
            (self.free_quant if is_q else self.free_fp).append(block)
        seq.block_table = []
        seq.num_cached = 0

    def compact(self, seq: Sequence, pools: KVPools) -> None:
        """Quantise every full block that has left the recent window (sink blocks stay FP16).

        Block b is out of the window once all its tokens are older than the last `window` cached ones.
        """
        if not self.quantised:
            return
        bs, first = self.block_size, -(-self.kv.sink_tokens // self.block_size)
        last = (seq.num_cached - self.kv.window) // bs   # blocks [first, last) are out of the window
        for b in range(first, last):
            is_q, fp_block = decode_block(seq.block_table[b])
            if is_q:
                continue
            if not self.free_quant:
                raise OutOfBlocks("quantised KV pool exhausted")
            q_block = self.free_quant.popleft()
            quantize_block(pools, None, fp_block, q_block)
            seq.block_table[b] = encode_quant_block(q_block)
            self.free_fp.append(fp_block)
