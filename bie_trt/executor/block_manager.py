"""Block bookkeeping over the two pools: FP16 for sinks / recent window / chunk in flight,
quantised for everything that has left the window, shared through the prefix cache. Host state
only: the copies and quantisations it decides are returned for the model runner to launch.

Every block-table entry (FP16 block e >= 0, quantised block -e - 1, see pool.py) that some table
holds has a reference count; an entry nobody holds is free, or cached (findable by its key, in an
LRU) until a hit takes it back or an allocation evicts it. Cached blocks are always evictable, so
the cache can never starve a running sequence.
"""
from __future__ import annotations

from collections import deque

from ..config import KVCacheConfig
from ..kv.pool import decode_block, encode_quant_block
from .prefix_cache import PrefixCache, block_key
from .sequence import Sequence

Copy = tuple[int, int]   # (source, destination) FP16 blocks
Quantisation = tuple[int, int]   # (FP16 block, quantised block id)


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the scheduler waits or preempts, never crashes."""


class BlockManager:
    def __init__(self, kv: KVCacheConfig, num_fp_blocks: int, num_quant_blocks: int,
                 enable_prefix_caching: bool = False):
        self.kv = kv
        self.num_fp_blocks, self.num_quant_blocks = num_fp_blocks, num_quant_blocks
        self.free_fp: deque[int] = deque(range(num_fp_blocks))
        self.free_quant: deque[int] = deque(range(num_quant_blocks))
        self.ref_counts: dict[int, int] = {}   # block-table entry -> tables holding it
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.quantised = kv.dtype != "fp16"

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_free_fp(self) -> int:
        """FP16 blocks a sequence could take now: free ones plus cached ones nobody holds."""
        return len(self.free_fp) + (self.cache.num_unused(False) if self.cache else 0)

    def usage(self, quantised: bool) -> dict[str, int]:
        """Blocks of one pool that sequences hold ("used"), cached ones nobody holds, and free ones."""
        free = len(self.free_quant if quantised else self.free_fp)
        cached = self.cache.num_unused(quantised) if self.cache else 0
        total = self.num_quant_blocks if quantised else self.num_fp_blocks
        return {"used": total - free - cached, "cached": cached, "free": free}

    # -- references ------------------------------------------------------------------------------
    def _take(self, quantised: bool) -> int:
        """A new entry held once: a free block, else the least recently used cached one."""
        free = self.free_quant if quantised else self.free_fp
        if free:
            block = free.popleft()
            entry = encode_quant_block(block) if quantised else block
        else:
            entry = self.cache.evict(quantised) if self.cache else None
            if entry is None:
                raise OutOfBlocks(f"the {'quantised' if quantised else 'FP16'} KV pool is exhausted")
        self.ref_counts[entry] = 1
        return entry

    def _share(self, entry: int) -> None:
        if entry in self.ref_counts:
            self.ref_counts[entry] += 1
        else:   # a cached entry nobody held
            self.cache.unpark(entry)
            self.ref_counts[entry] = 1

    def _release(self, entry: int) -> None:
        self.ref_counts[entry] -= 1
        if self.ref_counts[entry]:
            return
        del self.ref_counts[entry]
        if self.cache is None or not self.cache.park(entry):
            self._free(entry)

    def _free(self, entry: int) -> None:
        quantised, block = decode_block(entry)
        (self.free_quant if quantised else self.free_fp).append(block)

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Prefix-cache keys of seq's first `num_blocks` full blocks (computed once, kept on seq)."""
        bs = self.block_size
        for b in range(len(seq.block_keys), num_blocks):
            parent = seq.block_keys[b - 1] if b else None
            seq.block_keys.append(block_key(parent, seq.token_slice(b * bs, (b + 1) * bs)))
        return seq.block_keys[:num_blocks]

    # -- admission -------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """Cached entries for the longest run of seq's leading full blocks.

        The last token is always left to compute (its logits pick the next token), so a hit never
        covers the block that the sequence writes next. A quantised cache never hands out a quantised
        block where the sequence will keep FP16 once its prompt is in: its own recent window, judged
        from its own end (not the hit's, which would walk back block by block to the sinks whenever a
        longer sequence has quantised the shared prompt). The hit is cut once, at the first such block,
        so at most a window of tokens is recomputed.
        """
        if self.cache is None:
            return []
        hit: list[int] = []
        for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
            entry = self.cache.get(key)
            if entry is None:
                break
            hit.append(entry)
        window = self._first_window_block(seq.num_tokens)
        return next((hit[:b] for b in range(window, len(hit)) if hit[b] < 0), hit)

    def can_admit(self, hit: list[int], num_tokens: int) -> bool:
        """Whether a sequence can share `hit` and hold `num_tokens` tokens in all."""
        reclaimed = sum(1 for e in hit if e >= 0 and e not in self.ref_counts)   # leave the LRU on sharing
        return self._new_blocks(len(hit), num_tokens) <= self.num_free_fp - reclaimed

    def admit(self, seq: Sequence, hit: list[int]) -> None:
        """Start seq's table with the shared `hit` blocks; their tokens are computed already."""
        for entry in hit:
            self._share(entry)
        seq.block_table = list(hit)
        seq.num_cached = len(hit) * self.block_size

    # -- growth ----------------------------------------------------------------------------------
    def _new_blocks(self, num_held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index of the block seq writes next if another table holds it too (only after a fork: cached
        blocks are full and never written)."""
        b = seq.num_cached // self.block_size
        if b < len(seq.block_table) and self.ref_counts[seq.block_table[b]] > 1:
            return b
        return None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """FP16 blocks to take so the cache can hold `num_tokens` tokens of `seq`, copy-on-write included."""
        return self._new_blocks(len(seq.block_table), num_tokens) + (self._shared_write_block(seq) is not None)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_fp

    def grow(self, seq: Sequence, num_tokens: int) -> list[Copy]:
        """Take FP16 blocks so seq can hold `num_tokens` tokens. Returns the copy-on-write pairs the
        runner must copy before the step writes: a shared block is copied, not written."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_fp:
            raise OutOfBlocks(f"need {need} KV blocks, {self.num_free_fp} free")
        copies = []
        b = self._shared_write_block(seq)
        if b is not None:
            shared, own = seq.block_table[b], self._take(False)
            seq.block_table[b] = own
            self._release(shared)
            copies.append((shared, own))
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take(False))
        return copies

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """The step wrote K/V for seq's next `num_tokens` tokens: count them, and index the blocks
        they filled so later requests with the same prefix can share them."""
        before = seq.num_cached // self.block_size
        seq.num_cached += num_tokens
        if self.cache is None:
            return
        keys = self._keys(seq, seq.num_cached // self.block_size)
        for b in range(before, len(keys)):
            key = keys[b]
            if self.cache.get(key) is None:   # else an equal block is cached already: this one stays private
                self.cache.add(key, seq.block_table[b])

    def truncate(self, seq: Sequence) -> None:
        """Speculation's rollback: free the blocks past seq's cached tokens, which held only rejected
        proposals (never indexed: `commit` keys accepted tokens only). The table is then what a step
        without proposals leaves; rejected K/V left in the last block is overwritten before it is read."""
        keep = -(-seq.num_cached // self.block_size)
        for entry in reversed(seq.block_table[keep:]):
            self._release(entry)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (whose tokens start with parent's) continues from parent's cache, sharing every block;
        the partly filled last block is copied when either of them first writes it."""
        for entry in parent.block_table:
            self._share(entry)
        child.block_table = list(parent.block_table)
        child.num_cached = parent.num_cached
        child.block_keys = list(parent.block_keys)

    def free(self, seq: Sequence) -> None:
        # Tail first: in the LRU a prefix's later blocks are then evicted before the blocks they extend.
        for entry in reversed(seq.block_table):
            self._release(entry)
        seq.block_table = []
        seq.num_cached = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (benchmarks measure cold prefills with it)."""
        if self.cache:
            for quantised in (False, True):
                while (entry := self.cache.evict(quantised)) is not None:
                    self._free(entry)

    # -- the window ------------------------------------------------------------------------------
    def _first_window_block(self, num_cached: int) -> int:
        """Blocks before this index (after the sinks) have left the recent window."""
        return max(0, (num_cached - self.kv.window) // self.block_size)

    def compact(self, seq: Sequence) -> list[Quantisation]:
        """Quantise every full block that has left the recent window (sink blocks stay FP16).

        Block b is out of the window once all its tokens are older than the last `window` cached ones.
        A block already quantised under the same key by another sequence is shared instead of quantised
        again; a block this sequence quantises takes over the key, because the quantised copy is the one
        that lives on (the FP16 pool is only sinks + window + a chunk per sequence).
        Returns the (FP16 block, quantised block) pairs the runner must quantise before the next forward
        reads them (the FP16 blocks are released here, so before anything else is written into them).
        """
        first, end = -(-self.kv.sink_tokens // self.block_size), self._first_window_block(seq.num_cached)
        if not self.quantised or end <= first or max(seq.block_table[first:end]) < 0:
            return []   # the common case, checked at C speed: nothing new has left the window
        keys = self._keys(seq, end) if self.cache else None
        pairs: list[Quantisation] = []
        for b in range(first, end):
            entry = seq.block_table[b]
            if entry < 0:
                continue
            seq.block_table[b] = self._quantised_twin(entry, keys[b] if keys else None, pairs)
            self._release(entry)
        return pairs

    def _quantised_twin(self, entry: int, key: bytes | None, pairs: list[Quantisation]) -> int:
        cached = self.cache.get(key) if key else None
        if cached is not None and cached < 0:
            self._share(cached)
            return cached
        twin = self._take(True)
        pairs.append((entry, decode_block(twin)[1]))
        if key:
            if cached is not None and self.cache.drop(cached):
                self._free(cached)
            self.cache.add(key, twin)
        return twin
