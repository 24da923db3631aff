"""The block manager and prefix cache as a state machine over tiny fake pools: whatever the sequence of
admissions (with prefix hits), steps, forks, frees, cache resets and compactions, every block is owned
exactly once, reference counts are exact, and no sequence's (or cached block's) K/V ever changes."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.cache_tiers.exact_rows import quantised_end, sink_blocks
from bie_trt.executor.model_runner import copy_blocks, quantise_blocks
from bie_trt.cache_tiers.prefix_cache import PrefixCache
from bie_trt.executor.sequence import Sequence
from bie_trt.kv.pool import allocate_pools, decode_block
from bie_trt.kv.quant import dequantize_block, quantize_block
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams

MODEL = ModelConfig(architecture="LlamaForCausalLM", hidden_size=32, intermediate_size=32, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=32, vocab_size=4, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=64, tie_word_embeddings=True)
B = 4
NUM_FP, NUM_QUANT = 10, 12
TOKENS = st.sampled_from([0, 1])
BASE = [0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0]
# Prompts mostly start with a piece of one shared text, so prefix hits (and hits on blocks that another
# sequence has quantised meanwhile) are common.
PROMPTS = st.builds(lambda k, tail: BASE[:k] + tail, st.integers(0, len(BASE)),
                    st.lists(TOKENS, max_size=4)).filter(bool)


def new_seq(prompt: list[int], output: list[int] = ()) -> Sequence:
    return Sequence(list(prompt), SamplingParams(), make_generator(SamplingParams(), 0), output_ids=list(output))


def content(prefix: list[int]) -> float:
    """What a token's K holds: a function of the tokens up to it, as real K/V are. Every channel holds the
    same small integer, which INT4 stores exactly (the group's range is a single point)."""
    return float(1 + hash(tuple(prefix)) % 1000)


class BlockReader:
    """Tokens' K and V as the pools hold them; each block dequantised once per check (the checks read every
    cached token after every step, which dominates the machine's run time)."""

    def __init__(self, pools):
        self.pools, self.blocks = pools, {}

    def __call__(self, entry: int, offset: int) -> tuple[float, float]:
        if entry not in self.blocks:
            k, v = dequantize_block(self.pools, 0, entry)
            self.blocks[entry] = (k[0, :, 0].tolist(), v[0, :, 0].tolist())
        k, v = self.blocks[entry]
        return k[offset], v[offset]


class BlockMachine(RuleBasedStateMachine):
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=8, rotation="none", block_size=B)
    num_fp, num_quant = NUM_FP, NUM_QUANT

    def __init__(self):
        super().__init__()
        self.pools = allocate_pools(MODEL, self.kv, self.num_fp, self.num_quant, torch.float32)
        self.blocks = BlockManager(self.kv, self.num_fp, self.num_quant, enable_prefix_caching=True)
        self.seqs: list[Sequence] = []
        self.key_tokens: dict[bytes, list[int]] = {}   # every key ever made -> the tokens it stands for

    def _run(self, seq: Sequence, n: int, proposals: list[int] = ()) -> None:
        """One step of `seq` over its next n tokens and `proposals` after them (all rejected), as the engine
        does it: the "model" writes content(), then each run of rows reads its view."""
        copy_blocks(self.pools, self.blocks.grow(seq, seq.num_cached + n + len(proposals)))
        quantise_blocks(self.pools, self.blocks.compact(seq))
        start = seq.num_cached
        tokens = seq.token_slice(0, start + n) + list(proposals)
        views, now, pairs = self.blocks.row_views(seq, n + len(proposals))
        quantise_blocks(self.pools, now)   # the step launches these before the forward
        for p in range(start, len(tokens)):
            block = seq.block_table[p // B]
            self.pools.k[0, block, 0, p % B] = content(tokens[:p + 1])
            self.pools.v[0, block, 0, p % B] = -content(tokens[:p + 1])
        for fp, q in pairs:   # the forward quantises these per layer, after the K/V write
            quantize_block(self.pools, None, fp, q)
        self._check_views(seq, tokens, views)
        self.blocks.commit(seq, n)
        if proposals:
            self.blocks.truncate(seq)
        quantise_blocks(self.pools, self.blocks.compact(seq))

    def _check_views(self, seq: Sequence, tokens: list[int], views) -> None:
        """Each run reads every earlier token's K/V, quantised exactly where plain decoding had it."""
        read = BlockReader(self.pools)
        assert [row for row, _, _ in views] == list(itertools.accumulate([0] + [n for _, n, _ in views][:-1]))
        for row, rows, table in views:
            for pos in (seq.num_cached + row, seq.num_cached + row + rows - 1):
                end = quantised_end(pos, self.kv) if self.blocks.quantised else 0
                for b in range(pos // B + 1):
                    assert (table[b] < 0) == (sink_blocks(self.kv) <= b < end), (seq, pos, b)
                for p in range(pos + 1):
                    assert read(table[p // B], p % B) == (content(tokens[:p + 1]), -content(tokens[:p + 1]))

    @rule(prompt=PROMPTS, n=st.integers(1, 6))
    def admit(self, prompt, n):
        seq = new_seq(prompt)
        hit = self.blocks.match(seq)
        assert len(hit) * B < seq.num_tokens   # the last token is always computed: its logits are needed
        n = min(n, seq.num_tokens - len(hit) * B)
        if self.blocks.can_admit(hit, len(hit) * B + n):
            self.blocks.admit(seq, hit)
            self.seqs.append(seq)
            self._run(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(1, 6), token=TOKENS)
    def step(self, i, n, token):
        seq = self.seqs[i % len(self.seqs)]
        if seq.num_pending == 0:
            seq.output_ids.append(token)
        n = min(n, seq.num_pending)
        if self.blocks.can_grow(seq, seq.num_cached + n):
            self._run(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), proposals=st.lists(TOKENS, min_size=1, max_size=3))
    def verify(self, i, proposals):
        """A decode with proposals that are all rejected: twins made for rows past the pending token
        are kept for the next compaction or freed with the sequence, never leaked."""
        seq = self.seqs[i % len(self.seqs)]
        if seq.num_pending == 0:
            seq.output_ids.append(proposals[0])
        if seq.num_pending == 1 and self.blocks.can_grow(seq, seq.num_cached + 1 + len(proposals)):
            self._run(seq, 1, proposals)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.seqs[i % len(self.seqs)]
        child = new_seq(parent.prompt_ids, parent.output_ids)
        self.blocks.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        self.blocks.free(self.seqs.pop(i % len(self.seqs)))

    @rule()
    def reset_prefix_cache(self):
        self.blocks.reset_prefix_cache()

    @invariant()
    def every_block_owned_once_and_counted(self):
        bm, cache = self.blocks, self.blocks.cache
        held = Counter(e for s in self.seqs for e in s.block_table)
        assert set(bm.twins) <= set(self.seqs)   # twins made for rows past the window go with their sequence
        held.update(e for twins in bm.twins.values() for e in twins.values())
        assert all(len(set(s.block_table)) == len(s.block_table) for s in self.seqs)
        assert held == Counter(bm.ref_counts)
        for quantised, free, total in ((False, bm.free_fp, self.num_fp), (True, bm.free_quant, self.num_quant)):
            in_use = [decode_block(e)[1] for e in held if (e < 0) == quantised]
            parked = [decode_block(e)[1] for e in cache.unused[quantised]]
            assert all(e not in held and e in cache.key_of for e in cache.unused[quantised])
            assert sorted([*free, *in_use, *parked]) == list(range(total))
        assert cache.key_of == {e: k for k, e in cache.entry_of.items()}

    @invariant()
    def no_content_ever_changes(self):
        read = BlockReader(self.pools)
        for seq in self.seqs:
            tokens = seq.token_ids
            for p in range(seq.num_cached):
                want = content(tokens[:p + 1])
                assert read(seq.block_table[p // B], p % B) == (want, -want), (seq, p)
            for b, key in enumerate(seq.block_keys):
                self.key_tokens[key] = tokens[:(b + 1) * B]
        for key, entry in self.blocks.cache.entry_of.items():   # cached blocks too, held or not
            tokens = self.key_tokens[key[:16]]   # a quantised twin's key extends its block's
            for p in range(len(tokens) - B, len(tokens)):
                assert read(entry, p % B) == (content(tokens[:p + 1]), -content(tokens[:p + 1]))

    @invariant()
    def precision_follows_the_window(self):
        """Sink blocks and the window the sequence keeps at its end are FP16, everything older than the
        window of what is cached is quantised, hits included. Between the two (a hit's blocks while the
        rest of its prompt is computed) either precision is right."""
        sink_blocks = -(-self.kv.sink_tokens // B)
        for seq in self.seqs:
            old = max(0, (seq.num_cached - self.kv.window) // B) if self.blocks.quantised else 0
            recent = max(0, (seq.num_tokens - self.kv.window) // B) if self.blocks.quantised else 0
            for b, entry in enumerate(seq.block_table):
                if b < sink_blocks or b >= recent:
                    assert entry >= 0, (seq, b)
                elif b < old:
                    assert entry < 0, (seq, b)


class FP16BlockMachine(BlockMachine):
    kv = KVCacheConfig(dtype="fp16", block_size=B)


TestBlockManagerInt4 = BlockMachine.TestCase
TestBlockManagerFP16 = FP16BlockMachine.TestCase
# 100 runs of up to 30 steps find a hit handed out one block past the window and a cached block taken back
# without leaving the LRU; `-m slow` runs 300 of up to 50 steps.
TestBlockManagerInt4.settings = TestBlockManagerFP16.settings = settings(max_examples=50, stateful_step_count=30,
                                                                         deadline=None)
THOROUGH = settings(max_examples=300, stateful_step_count=50, deadline=None)


@pytest.mark.slow
class TestBlockManagerInt4Thorough(BlockMachine.TestCase):
    settings = THOROUGH


@pytest.mark.slow
class TestBlockManagerFP16Thorough(FP16BlockMachine.TestCase):
    settings = THOROUGH


def test_a_write_into_a_forked_block_copies_it_first():
    kv = KVCacheConfig(dtype="fp16", block_size=B)
    pools = allocate_pools(MODEL, kv, 4, 0, torch.float32)
    bm = BlockManager(kv, 4, 0, enable_prefix_caching=True)
    parent = new_seq([0, 1, 0, 1, 1, 1])
    bm.admit(parent, [])
    bm.grow(parent, 6)
    pools.k[0, parent.block_table[1], 0, :2] = 7.0
    bm.commit(parent, 6)
    child = new_seq(parent.prompt_ids)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.ref_counts[parent.block_table[1]] == 2

    child.output_ids.append(0)
    copies = bm.grow(child, 7)          # the partly filled block is shared: the child gets its own copy
    assert copies == [(parent.block_table[1], child.block_table[1])]
    copy_blocks(pools, copies)
    pools.k[0, child.block_table[1], 0, 2] = 9.0
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert pools.k[0, child.block_table[1], 0, :2].eq(7.0).all()      # the copy carries the shared tokens
    assert pools.k[0, parent.block_table[1], 0, 2].eq(0.0).all()      # the parent's block is untouched
    parent.output_ids.append(1)
    assert bm.grow(parent, 7) == []     # now the parent holds its block alone: written in place


def run_through(bm: BlockManager, pools, seq: Sequence, chunk: int) -> None:
    """Prefill seq in chunks as the engine does: grow, (write), commit, compact."""
    while seq.num_pending:
        n = min(chunk, seq.num_pending)
        bm.grow(seq, seq.num_cached + n)
        bm.commit(seq, n)
        quantise_blocks(pools, bm.compact(seq))


def test_sinks_that_do_not_fill_a_block_keep_it_fp16():
    # 8 sink tokens in 16-token blocks: block 0 holds sinks and ordinary tokens, and stays FP16 whole.
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=8, window=32, rotation="none", block_size=16)
    pools = allocate_pools(MODEL, kv, 8, 8, torch.float32)
    bm = BlockManager(kv, 8, 8)
    seq = new_seq([1] * 100)
    bm.admit(seq, [])
    run_through(bm, pools, seq, chunk=16)
    # 100 tokens: blocks 0..6; the window (last 32 tokens, 68..99) starts in block 4
    assert [e < 0 for e in seq.block_table] == [False, True, True, True, False, False, False]


def test_prefix_keys_chain_their_parents():
    # Block 1 of `first` and block 0 of `second` hold the same tokens at different positions (different
    # K/V): the keys differ, so `second` gets no hit.
    kv = KVCacheConfig(dtype="fp16", block_size=B)
    bm = BlockManager(kv, 8, 0, enable_prefix_caching=True)
    pools = allocate_pools(MODEL, kv, 8, 0, torch.float32)
    block = [1, 0, 1, 1]
    first = new_seq([0, 0, 0, 0] + block + [1])
    bm.admit(first, [])
    run_through(bm, pools, first, chunk=9)
    assert len(bm.cache.entry_of) == 2
    assert bm.match(new_seq(block + block + [0])) == []
    assert bm.match(new_seq([1, 1, 1, 1] + block + [0])) == []          # same block after another prefix
    assert bm.match(new_seq([0, 0, 0, 0] + block + [0])) == first.block_table[:2]


def test_token_slice_equals_slicing_the_whole_token_list():
    # Block keys slice across the prompt / output boundary; token_slice avoids building token_ids.
    for num_prompt in (1, 3, 4):
        for num_output in (0, 1, 5):
            seq = new_seq(list(range(num_prompt)), list(range(10, 10 + num_output)))
            tokens = seq.token_ids
            for start in range(len(tokens) + 1):
                for stop in range(start, len(tokens) + 2):
                    assert seq.token_slice(start, stop) == tokens[start:stop], (num_prompt, num_output, start, stop)


def test_the_lru_evicts_the_least_recently_released_block_first():
    cache = PrefixCache()
    for entry, key in ((3, b"a"), (5, b"b"), (-2, b"q"), (7, b"c")):
        cache.add(key, entry)
        cache.park(entry)
    cache.unpark(5)                      # a hit takes it back...
    cache.park(5)                        # ...and its release makes it the most recent
    assert (cache.num_unused(False), cache.num_unused(True)) == (3, 1)
    assert [cache.evict(False) for _ in range(4)] == [3, 7, 5, None]
    assert cache.evict(True) == -2 and cache.entry_of == {} and cache.key_of == {}


def test_a_write_into_a_shared_block_needs_a_free_block_for_the_copy():
    kv = KVCacheConfig(dtype="fp16", block_size=B)
    bm = BlockManager(kv, 2, 0)
    parent = new_seq([0, 1, 0, 1, 1, 1])
    bm.admit(parent, [])
    bm.grow(parent, 6)
    bm.commit(parent, 6)
    child = new_seq(parent.prompt_ids, [0])
    bm.fork(parent, child)                # the pool is full; the child's next token lands in a shared block
    assert bm.blocks_needed(child, 7) == 1 and not bm.can_grow(child, 7)
    bm.free(parent)
    assert bm.blocks_needed(child, 7) == 0 and bm.can_grow(child, 7)   # now it owns the block alone


def test_resetting_the_prefix_cache_empties_both_pools():
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=8, rotation="none", block_size=B)
    pools = allocate_pools(MODEL, kv, NUM_FP, NUM_QUANT, torch.float32)
    bm = BlockManager(kv, NUM_FP, NUM_QUANT, enable_prefix_caching=True)
    seq = new_seq(BASE)
    bm.admit(seq, [])
    run_through(bm, pools, seq, chunk=4)
    bm.free(seq)
    assert bm.usage(False)["cached"] > 0 and bm.usage(True)["cached"] > 0
    bm.reset_prefix_cache()
    assert bm.usage(False) == {"used": 0, "cached": 0, "free": NUM_FP}
    assert bm.usage(True) == {"used": 0, "cached": 0, "free": NUM_QUANT}
    assert bm.match(new_seq(BASE)) == [] and bm.cache.entry_of == {}
