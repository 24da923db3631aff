"""The sliding-window layers' cache group of a hybrid model (Gemma 3): FP16 blocks in a pool of their own,
one table per sequence (`Sequence.sliding_table`), given back as the window slides past them.

The table is positional like the full layers' (entry b holds positions b*B .. b*B + B - 1), so one position
has one block index in both groups. A row at position p reads positions p - window + 1 .. p only, and a
step's earliest row is the sequence's first uncached position (a decode, a prefill chunk's first row, a
verify's first row: its later rows read less), so once `num_cached` tokens are computed every block wholly
below `num_cached - window + 1` is never read again: `slide` gives it back and leaves PAD in its place.

Prefix caching: a full block is indexed under the same key as its full-layer twin (prefix_cache.py). A
block given back that has a key waits in the LRU (counted as cached, not in use) until an allocation
evicts it, so the blocks of the last window of every recent prompt stay findable: a hit of h blocks needs,
besides the full layers' h blocks, the sliding blocks that the first recomputed row (position h*B) reads,
`first_read(h*B)` .. h - 1. They are never written again (a hit leaves the last token to compute), so
sharing them is exact. Sliding blocks stay on the device: the host and disk tiers keep no sliding blocks
(a hybrid engine runs without them).
"""
from __future__ import annotations

from collections import deque

from .prefix_cache import PrefixCache, release, share
from ..executor.sequence import Sequence

# The table entry of a block given back (or never held, below a prefix hit's window). Any valid block id:
# the kernels never read below a row's window, and a real id keeps an unmasked address in bounds.
PAD = 0


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the scheduler waits or preempts, never crashes."""


class SlidingBlocks:
    def __init__(self, window: int, block_size: int, num_blocks: int, enable_prefix_caching: bool):
        self.window, self.block_size, self.num_blocks = window, block_size, num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.ref_counts: dict[int, int] = {}
        self.cache = PrefixCache() if enable_prefix_caching else None

    def first_read(self, pos: int) -> int:
        """The first block the row at `pos` reads: the one holding position pos - window + 1."""
        return max(0, pos - self.window + 1) // self.block_size

    @property
    def num_free(self) -> int:
        """Blocks a sequence could take now: free ones plus cached ones nobody holds."""
        return len(self.free) + (self.cache.num_unused(False) if self.cache else 0)

    def usage(self) -> dict[str, int]:
        cached = self.cache.num_unused(False) if self.cache else 0
        return {"used": self.num_blocks - len(self.free) - cached, "cached": cached, "free": len(self.free)}

    def held(self, seq: Sequence) -> int:
        """Blocks seq holds in this group."""
        return len(seq.sliding_table) - seq.sliding_first

    # -- references ------------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block = self.cache.evict(False) if self.cache else None
            if block is None:
                raise OutOfBlocks("the sliding-window KV pool is exhausted")
        self.ref_counts[block] = 1
        return block

    def _share(self, block: int) -> None:
        share(self.ref_counts, self.cache, block)

    def _release(self, block: int) -> None:
        if release(self.ref_counts, self.cache, block):
            self.free.append(block)

    # -- prefix hits -----------------------------------------------------------------------------
    def hit(self, keys: list[bytes], h: int) -> list[int] | None:
        """The cached blocks a hit of `h` blocks (keys[:h]) needs here, first_read(h*B) .. h - 1; None when one
        is missing."""
        found = [self.cache.get(keys[b]) for b in range(self.first_read(h * self.block_size), h)]
        return None if None in found else found

    def admission_need(self, keys: list[bytes], h: int, num_tokens: int) -> int:
        """Blocks admitting a hit of `h` blocks and holding `num_tokens` tokens would take from the free count."""
        unparked = sum(block not in self.ref_counts for block in self.hit(keys, h) or [])
        return unparked + max(0, -(-num_tokens // self.block_size) - h)

    def admit(self, seq: Sequence, keys: list[bytes], h: int) -> None:
        """Start seq's table with the hit's window blocks, shared (PAD below them)."""
        blocks = self.hit(keys, h) if h else []
        for block in blocks:
            self._share(block)
        seq.sliding_first = h - len(blocks)
        seq.sliding_table = [PAD] * seq.sliding_first + blocks

    # -- growth and the window -------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.sliding_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.sliding_table) * self.block_size < num_tokens:
            seq.sliding_table.append(self._take())

    def commit(self, seq: Sequence, keys: list[bytes], first: int) -> None:
        """Index seq's newly full blocks first.. under their keys (unless an equal block is cached already)."""
        if self.cache is None:
            return
        for b in range(max(first, seq.sliding_first), len(keys)):
            if self.cache.get(keys[b]) is None:
                self.cache.add(keys[b], seq.sliding_table[b])

    def slide(self, seq: Sequence) -> None:
        """Give back every block wholly below the window of seq's next row (position num_cached)."""
        end = min(self.first_read(seq.num_cached), len(seq.sliding_table))
        for b in range(seq.sliding_first, end):
            self._release(seq.sliding_table[b])
            seq.sliding_table[b] = PAD
        seq.sliding_first = max(seq.sliding_first, end)

    def truncate(self, seq: Sequence) -> None:
        """Speculation's rollback: the blocks past seq's cached tokens held only rejected proposals."""
        keep = max(-(-seq.num_cached // self.block_size), seq.sliding_first)
        for block in reversed(seq.sliding_table[keep:]):
            self._release(block)
        del seq.sliding_table[keep:]

    def free_seq(self, seq: Sequence) -> None:
        # Tail first, as the full group does: a prefix's later blocks leave the LRU before those they extend.
        for block in reversed(seq.sliding_table[seq.sliding_first:]):
            self._release(block)
        seq.sliding_table, seq.sliding_first = [], 0

    def reset_prefix_cache(self) -> None:
        if self.cache:
            while (block := self.cache.evict(False)) is not None:
                self.free.append(block)
