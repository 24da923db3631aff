"""Block bookkeeping over the two pools: FP16 for sinks / recent window / chunk in flight,
quantised for everything that has left the window, shared through the prefix cache. Host state
only: the copies and quantisations it decides are returned for the model runner to launch, and so
are the moves of the host tier (host_cache.py), listed in `host_moves` in the order decided.

Every block-table entry (FP16 block e >= 0, quantised block -e - 1, see pool.py) that some table
holds has a reference count; an entry nobody holds is free, or cached (findable by its key, in an
LRU) until a hit takes it back or an allocation evicts it. Cached blocks are always evictable, so
the cache can never starve a running sequence. With a host tier, an evicted block's bytes move to
host memory (an `Offload` before the device block is reused) and a hit there comes back into a free
device block (a `Restore` before the step that reads it); a full host tier drops its oldest blocks.

A hybrid model's sliding-window layers are a second cache group with tables of their own (`sliding`,
sliding_blocks.py): every call here keeps both groups in step, a prefix hit needs both, and such an engine
keeps no host tier (its sliding blocks would have to travel with the full layers' ones).

A model with linear-attention layers (Qwen3.5) adds the recurrent group's snapshots (`snapshots`,
state_snapshots.py): a hit also stops at the last block boundary whose state was saved, and such an engine keeps
no host tier either (the snapshots stay on the device).
"""
from __future__ import annotations

import itertools
from collections import deque

from ..config import KVCacheConfig
from ..kv.pool import decode_block, encode_quant_block
from .exact_rows import quantised_end, runs, sink_blocks
from .host_cache import HostCache, HostMove, Offload, Restore
from .prefix_cache import PrefixCache, block_key, quant_key, release, share
from ..executor.sequence import Sequence
from .sliding_blocks import OutOfBlocks, SlidingBlocks
from .state_snapshots import StateSnapshots

Copy = tuple[int, int]   # (source, destination) FP16 blocks
Quantisation = tuple[int, int]   # (FP16 block, quantised block id)
View = tuple[int, int, list[int]]   # (first row, rows, block table those rows read)
Hit = int | bytes   # a device block-table entry, or the key of a block waiting in the host tier
# An FP16 copy of a block that also has a quantised twin goes to the host tier only when its tokens lie
# within the window plus this many tokens of the end of a prompt: only a hit ending near it reads it in
# FP16, and a document's body would otherwise cost the tier four times its quantised size.
HOST_TAIL_TOKENS = 512


class BlockManager:
    def __init__(self, kv: KVCacheConfig, num_fp_blocks: int, num_quant_blocks: int,
                 enable_prefix_caching: bool = False, host_bytes: int = 0,
                 block_bytes: dict[bool, int] | None = None, host_tail_tokens: int = HOST_TAIL_TOKENS,
                 sliding_window: int = 0, num_sliding_blocks: int = 0, snapshots: StateSnapshots | None = None):
        """`host_bytes` > 0 (with prefix caching) keeps evicted blocks in a host tier of that many bytes;
        `block_bytes`: is quantised -> bytes of one block, every layer's K and V. `sliding_window` > 0: a hybrid
        model, whose sliding layers' group has `num_sliding_blocks` FP16 blocks (and no host tier).
        `snapshots`: a model with linear-attention layers, with prefix caching (and no host tier)."""
        self.kv = kv
        self.num_fp_blocks, self.num_quant_blocks = num_fp_blocks, num_quant_blocks
        self.free_fp: deque[int] = deque(range(num_fp_blocks))
        self.free_quant: deque[int] = deque(range(num_quant_blocks))
        self.ref_counts: dict[int, int] = {}   # block-table entry -> tables holding it
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.sliding = (SlidingBlocks(sliding_window, kv.block_size, num_sliding_blocks, enable_prefix_caching)
                        if sliding_window else None)
        self.snapshots = snapshots if self.cache is not None else None
        self.quantised = kv.dtype != "fp16"
        self._slots = itertools.count()   # host slots: the tier's, and blocks loaded from a file
        self.host = (HostCache(host_bytes, block_bytes, self._slots)
                     if self.cache is not None and host_bytes > 0 and self.sliding is None and self.snapshots is None
                     else None)
        self.host_moves: list[HostMove] = []   # decided since the scheduler last took them
        self.host_tail_tokens = host_tail_tokens
        self.tail: set[int] = set()   # FP16 entries near a prompt's end: worth the host tier even with a twin
        # Quantised twins made before compaction (for rows that read a block quantised before the
        # sequence's own window has moved past it), held until `compact` takes them over: block -> entry.
        self.twins: dict[Sequence, dict[int, int]] = {}

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def num_free_fp(self) -> int:
        """FP16 blocks a sequence could take now: free ones plus cached ones nobody holds."""
        return len(self.free_fp) + (self.cache.num_unused(False) if self.cache else 0)

    @property
    def num_free_quant(self) -> int:
        return len(self.free_quant) + (self.cache.num_unused(True) if self.cache else 0)

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
            entry = self._evict(quantised)
            if entry is None:
                raise OutOfBlocks(f"the {'quantised' if quantised else 'FP16'} KV pool is exhausted")
        self.ref_counts[entry] = 1
        return entry

    def _evict(self, quantised: bool) -> int | None:
        """The least recently used cached entry of one pool, forgotten by the device cache; with a host
        tier its bytes are offloaded there first."""
        oldest = self.cache.evict_keyed(quantised) if self.cache else None
        if oldest is None:
            return None
        entry, key = oldest
        tail = entry in self.tail
        self.tail.discard(entry)
        if self.host is not None and (quantised or tail or self._find(quant_key(key)) is None):
            slot = self.host.put(key, quantised, self.host_moves, tail)
            if slot is not None:
                self.host_moves.append(Offload(entry, slot))
        return entry

    def _mark_tail(self, seq: Sequence, b: int, entry: int) -> None:
        """Note FP16 block b of seq as worth the host tier if a hit near the end of seq's prompt reads it
        (see HOST_TAIL_TOKENS); called as seq lets go of it."""
        if self.host is None or not self.quantised or entry < 0:
            return
        hit_end = (len(seq.prompt_ids) - 1) // self.block_size * self.block_size   # where a hit on it stops
        if b >= quantised_end(hit_end - self.host_tail_tokens, self.kv):   # in the FP16 window such hits read
            self.tail.add(entry)

    def _index(self, key: bytes, entry: int) -> None:
        """Cache `entry` under `key` on the device; a copy the host tier still had is dropped (a block lives
        in one tier)."""
        self.cache.add(key, entry)
        if self.host is not None:
            self.host.discard(key, self.host_moves)

    def new_slot(self) -> int:
        """A host slot for a block that arrives from outside the tier (a cache file), for `adopt`."""
        return next(self._slots)

    def adopt(self, key: bytes, quantised: bool, slot: int) -> bool:
        """Cache a block whose bytes wait in host `slot` (read from a cache file) on the device under `key`,
        unreferenced (a `Restore` move copies it in). False, leaving the slot to the caller, when `key` is
        cached already or every device block of its kind is held."""
        if self.cache is None or self._find(key) is not None:
            return False
        try:
            entry = self._take(quantised)
        except OutOfBlocks:
            return False
        self.host_moves.append(Restore(slot, entry))
        self._index(key, entry)
        self._release(entry)
        return True

    def take_host_moves(self) -> list[HostMove]:
        """The host tier's moves decided since the last call, in order, for the runner to launch."""
        moves, self.host_moves = self.host_moves, []
        return moves

    def _share(self, entry: int) -> None:
        share(self.ref_counts, self.cache, entry)

    def _release(self, entry: int) -> None:
        if release(self.ref_counts, self.cache, entry):
            self._free(entry)

    def _free(self, entry: int) -> None:
        self.tail.discard(entry)
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
    def _find(self, key: bytes) -> Hit | None:
        """Where the block cached under `key` is: its device entry, else the key itself if the host tier
        has it, else None."""
        entry = self.cache.get(key)
        if entry is None and self.host is not None and key in self.host:
            return key
        return entry

    def prompt_keys(self, seq: Sequence) -> list[bytes]:
        """The keys of seq's full blocks a hit may cover (all but the block of its last token)."""
        return self._keys(seq, (seq.num_tokens - 1) // self.block_size)

    def holds(self, key: bytes) -> bool:
        """Whether the device or the host tier caches a block under `key`."""
        return self._find(key) is not None

    def match(self, seq: Sequence) -> list[Hit]:
        """Cached entries (device entries, or host-tier keys that `admit` restores) for the longest run of
        seq's leading full blocks that the first token computed after them would read as plain decoding
        does (see exact_rows).

        The last token is always left to compute (its logits pick the next token), so a hit never
        covers the block that the sequence writes next. With a quantised cache a hit of h blocks needs
        FP16 copies of the sinks and of the blocks still in the window at position h * block_size; the
        blocks before that window may be either copy (compaction quantises an FP16 one at once). A
        block's FP16 copy and its quantised twin are cached under separate keys, so a hit is cut only
        where the FP16 copies were evicted.
        """
        if self.cache is None:
            return []
        fp, quant = [], []
        keys = self.prompt_keys(seq)

        def groups_ok(h: int) -> bool:   # a hybrid model's sliding layers hold the window the hit's end reads,
            # and its linear-attention layers' state was saved at the hit's end
            return ((self.sliding is None or self.sliding.hit(keys, h) is not None)
                    and (self.snapshots is None or h == 0 or self.snapshots.has(keys[h - 1])))

        for key in keys:
            fp.append(self._find(key))
            quant.append(self._find(quant_key(key)) if self.quantised else None)
            if fp[-1] is None and quant[-1] is None:
                fp.pop(), quant.pop()
                break
        if not self.quantised:
            return fp[:next(h for h in range(len(fp), -1, -1) if groups_ok(h))]
        sinks = sink_blocks(self.kv)
        for h in range(len(fp), 0, -1):
            end = min(quantised_end(h * self.block_size, self.kv), h)
            if (all(fp[b] is not None for b in range(min(sinks, h))) and all(fp[b] is not None for b in range(end, h))
                    and groups_ok(h)):
                return [quant[b] if sinks <= b < end and quant[b] is not None else fp[b] for b in range(h)]
        return []

    def can_admit(self, hit: list[Hit], num_tokens: int, seq: Sequence | None = None) -> bool:
        """Whether a sequence can share `hit` (restoring its host blocks) and hold `num_tokens` tokens in all.
        A hybrid model needs `seq` (the hit's keys find its sliding blocks)."""
        need = {False: self._new_blocks(len(hit), num_tokens), True: 0}
        for item in hit:
            if isinstance(item, bytes):        # a restore takes a device block of its kind
                need[self.host.blocks[item][1]] += 1
            elif item not in self.ref_counts:  # leaves the LRU on sharing
                need[item < 0] += 1
        if self.sliding is not None and (self.sliding.admission_need(self.prompt_keys(seq), len(hit), num_tokens)
                                         > self.sliding.num_free):
            return False
        return need[False] <= self.num_free_fp and need[True] <= self.num_free_quant

    def admit(self, seq: Sequence, hit: list[Hit]) -> None:
        """Start seq's table with the `hit` blocks, shared, or restored from the host tier into free device
        blocks (`Restore` moves); their tokens are computed already."""
        for item in hit:
            if isinstance(item, int):   # shared before a restore's allocation could evict it
                self._share(item)
        # out of the host tier before an offload below could push them out of it
        taken = {item: self.host.take(item) for item in hit if isinstance(item, bytes)}
        seq.block_table = []
        for item in hit:
            if isinstance(item, bytes):
                slot, quantised, tail = taken[item]
                entry = self._take(quantised)
                if tail:
                    self.tail.add(entry)
                self.host_moves.append(Restore(slot, entry))
                self.cache.add(item, entry)
                item = entry
            seq.block_table.append(item)
        seq.num_cached = len(hit) * self.block_size
        if self.sliding is not None:
            self.sliding.admit(seq, self.prompt_keys(seq), len(hit))

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
        return self.blocks_needed(seq, num_tokens) <= self.num_free_fp and (
            self.sliding is None or self.sliding.blocks_needed(seq, num_tokens) <= self.sliding.num_free)

    def grow(self, seq: Sequence, num_tokens: int) -> list[Copy]:
        """Take FP16 blocks so seq can hold `num_tokens` tokens. Returns the copy-on-write pairs the
        runner must copy before the step writes: a shared block is copied, not written."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_fp:
            raise OutOfBlocks(f"need {need} KV blocks, {self.num_free_fp} free")
        if self.sliding is not None:
            if (sliding := self.sliding.blocks_needed(seq, num_tokens)) > self.sliding.num_free:
                raise OutOfBlocks(f"need {sliding} sliding-window KV blocks, {self.sliding.num_free} free")
            self.sliding.grow(seq, num_tokens)
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
                self._index(key, seq.block_table[b])
        if self.sliding is not None:
            self.sliding.commit(seq, keys, before)

    def truncate(self, seq: Sequence) -> None:
        """Speculation's rollback: free the blocks past seq's cached tokens, which held only rejected
        proposals (never indexed: `commit` keys accepted tokens only). The table is then what a step
        without proposals leaves; rejected K/V left in the last block is overwritten before it is read."""
        keep = -(-seq.num_cached // self.block_size)
        for entry in reversed(seq.block_table[keep:]):
            self._release(entry)
        del seq.block_table[keep:]
        if self.sliding is not None:
            self.sliding.truncate(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (whose tokens start with parent's) continues from parent's cache, sharing every block;
        the partly filled last block is copied when either of them first writes it."""
        if self.sliding is not None:
            raise NotImplementedError("fork of a hybrid model's sequence: the sliding-window layers' blocks have "
                                      "no copy-on-write")
        for entry in parent.block_table:
            self._share(entry)
        child.block_table = list(parent.block_table)
        child.num_cached = parent.num_cached
        child.block_keys = list(parent.block_keys)

    def free(self, seq: Sequence) -> None:
        # Tail first: in the LRU a prefix's later blocks are then evicted before the blocks they extend.
        for b in reversed(range(len(seq.block_table))):
            self._mark_tail(seq, b, seq.block_table[b])
            self._release(seq.block_table[b])
        for entry in self.twins.pop(seq, {}).values():
            self._release(entry)
        if self.sliding is not None:
            self.sliding.free_seq(seq)
        seq.block_table = []
        seq.num_cached = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds, in both tiers (benchmarks measure cold
        prefills with it)."""
        if self.cache:
            for quantised in (False, True):
                while (entry := self.cache.evict(quantised)) is not None:
                    self._free(entry)
        if self.host is not None:
            self.host.clear(self.host_moves)
        if self.sliding is not None:
            self.sliding.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    # -- the window ------------------------------------------------------------------------------
    def compact(self, seq: Sequence) -> list[Quantisation]:
        """Quantise every full block that has left the recent window (sink blocks stay FP16); a hybrid model's
        sliding layers give back the blocks below their window (SlidingBlocks.slide).

        Block b is out of the window once all its tokens are older than the last `window` cached ones.
        A twin `row_views` made for the block already is taken over; a block already quantised under
        the same key by another sequence is shared instead of quantised again. The FP16 copy stays
        cached (under its own key) until evicted, for hits that need it in their window.
        Returns the (FP16 block, quantised block) pairs the runner must quantise before the next forward
        reads them (the FP16 blocks are released here, so before anything else is written into them).
        """
        if self.sliding is not None:   # the sliding layers give back what left their window
            self.sliding.slide(seq)
        first, end = sink_blocks(self.kv), quantised_end(seq.num_cached, self.kv)
        if not self.quantised or end <= first or max(seq.block_table[first:end]) < 0:
            return []   # the common case, checked at C speed: nothing new has left the window
        keys = self._keys(seq, end) if self.cache else None
        twins = self.twins.get(seq, {})
        pairs: list[Quantisation] = []
        for b in range(first, end):
            entry = seq.block_table[b]
            if entry < 0:
                continue
            twin = twins.pop(b, None)
            if twin is None:
                twin = self._quantised_twin(entry, keys[b] if keys else None, pairs)
            elif keys and self.cache.get(quant_key(keys[b])) is None:
                self._index(quant_key(keys[b]), twin)
            seq.block_table[b] = twin
            self._mark_tail(seq, b, entry)
            self._release(entry)
        return pairs

    def _quantised_twin(self, entry: int, key: bytes | None, pairs: list[Quantisation]) -> int:
        """A quantised copy of FP16 `entry`, held once: the cached one under `key`, else a new block
        (listed in `pairs` for the runner to quantise) indexed under `key`."""
        qkey = quant_key(key) if key else None
        cached = self.cache.get(qkey) if qkey else None
        if cached is not None:
            self._share(cached)
            return cached
        twin = self._take(True)
        pairs.append((entry, decode_block(twin)[1]))
        if qkey:
            self._index(qkey, twin)
        return twin

    def row_views(self, seq: Sequence, num_rows: int
                  ) -> tuple[list[View], list[Quantisation], list[Quantisation]]:
        """This step's rows of seq (positions num_cached..) cut into runs that read the same blocks
        quantised, each with the table it reads: seq's, with quantised twins for the blocks plain decoding
        had quantised at that run's position (exact_rows). Call after `compact`: the first run reads seq's
        own table as it is. -> (views, twins of blocks full before the step, to quantise before the forward;
        twins of blocks this step writes, which the forward quantises per layer between writing K/V and
        attention). The twins are held until `compact` takes them over or seq is freed; the FP16 copies
        stay in seq's table, read by the earlier runs."""
        start = seq.num_cached
        (_, rows, done), *later = runs(start, num_rows, self.kv)
        view = seq.block_table   # compaction left it as the first run reads it: no per-step scan of the table
        views: list[View] = [(0, rows, view)]
        now: list[Quantisation] = []
        per_layer: list[Quantisation] = []
        for row, rows, end in later:
            view = list(view)
            for b in range(done, end):
                if view[b] >= 0:
                    view[b] = self._pending_twin(seq, b, start, now, per_layer)
            views.append((row, rows, view))
            done = end
        return views, now, per_layer

    def _pending_twin(self, seq: Sequence, b: int, start: int, now: list[Quantisation],
                      per_layer: list[Quantisation]) -> int:
        twins = self.twins.setdefault(seq, {})
        if b not in twins:
            if (b + 1) * self.block_size <= start:   # its tokens are final: quantised now, shared through the cache
                key = self._keys(seq, b + 1)[b] if self.cache else None
                twins[b] = self._quantised_twin(seq.block_table[b], key, now)
            else:   # written this step: quantised per layer by the forward, indexed once compacted
                twins[b] = self._quantised_twin(seq.block_table[b], None, per_layer)
        return twins[b]
