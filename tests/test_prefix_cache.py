"""Prefix cache: what is shared, what is evicted and when, quantised blocks, and on the SmolLM2 engine a
2k-token shared prefix that cuts the time to first token without changing the logits, and a long document
found again after another request quantised it."""
from __future__ import annotations


import pytest
import torch

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.config import KVCacheConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.model_runner import quantise_blocks
from bie_trt.cache_tiers.prefix_cache import quant_key
from bie_trt.kv.pool import allocate_pools
from test_block_manager import MODEL, new_seq

B = 4


def run(bm: BlockManager, seq, pools=None) -> None:
    """Admit seq with its prefix hit and compute all its tokens in one step."""
    bm.admit(seq, bm.match(seq))
    n = seq.num_pending
    bm.grow(seq, seq.num_cached + n)
    bm.commit(seq, n)
    if pools is not None:
        quantise_blocks(pools, bm.compact(seq))


def test_a_hit_always_leaves_the_last_token_to_compute():
    bm = BlockManager(KVCacheConfig(block_size=B), 8, 0, enable_prefix_caching=True)
    run(bm, new_seq(list(range(8))))
    assert len(bm.match(new_seq(list(range(8))))) == 1        # two full blocks cached, one reused
    assert len(bm.match(new_seq(list(range(9))))) == 2
    assert len(bm.match(new_seq([9] + list(range(8))))) == 0  # keys chain: same tokens, other prefix


def test_unreferenced_blocks_wait_in_an_lru_and_yield_to_new_sequences():
    bm = BlockManager(KVCacheConfig(block_size=B), 4, 0, enable_prefix_caching=True)
    a = new_seq(list(range(13)))
    run(bm, a)
    bm.free(a)
    assert bm.usage(False) == {"used": 0, "cached": 3, "free": 1} and bm.num_free_fp == 4
    other = new_seq([7] * 5)                 # needs 2 blocks: the free one, then the LRU's oldest
    run(bm, other)
    assert bm.usage(False) == {"used": 2, "cached": 2, "free": 0}
    # a freed sequence's tail goes first, so its prefix is still there
    assert len(bm.match(new_seq(list(range(13))))) == 2
    assert bm.can_grow(other, 4 * B)         # cached blocks never starve a running sequence
    bm.grow(other, 4 * B)
    assert bm.usage(False) == {"used": 4, "cached": 0, "free": 0}


def test_a_quantised_twin_is_cached_beside_its_fp16_copy_and_shared():
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=8, rotation="none", block_size=B)
    pools = allocate_pools(MODEL, kv, 16, 16, torch.float32)
    bm = BlockManager(kv, 16, 16, enable_prefix_caching=True)
    prompt = list(range(20))
    a = new_seq(prompt)
    run(bm, a, pools)
    assert [e < 0 for e in a.block_table] == [False, True, True, False, False]
    assert bm.cache.get(quant_key(a.block_keys[1])) == a.block_table[1]   # the twin has a key of its own
    fp_copy = bm.cache.get(a.block_keys[1])
    assert fp_copy >= 0 and fp_copy not in bm.ref_counts                   # the FP16 copy waits in the LRU
    # A shorter prompt's first recomputed token (position 8) reads block 1 in FP16, as plain decoding
    # does there: the hit takes the FP16 copy; its own quantisation then reuses a's twins.
    b = new_seq(prompt[:12])
    assert bm.match(b) == [a.block_table[0], fp_copy]
    run(bm, b, pools)
    b.output_ids += [1, 2, 3, 4, 5, 6, 7, 8]
    bm.grow(b, 20)
    bm.commit(b, 8)
    quantise_blocks(pools, bm.compact(b))
    assert b.block_table[1:3] == a.block_table[1:3] and bm.usage(True)["used"] == 2
    # a longer prompt whose window lies past them takes the twins straight from the cache
    c = new_seq(prompt + [1, 2, 3, 4])
    assert bm.match(c) == a.block_table


def _quantised_bm(num_fp: int = 64, num_quant: int = 64):
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=8, rotation="none", block_size=B)
    return allocate_pools(MODEL, kv, num_fp, num_quant, torch.float32), BlockManager(kv, num_fp, num_quant, True)


def decode(bm: BlockManager, seq, pools, n: int) -> None:
    """n decode steps: each appends a token and caches it, blocks leaving the window are quantised."""
    for i in range(n):
        seq.output_ids.append(1000 + i)
        bm.grow(seq, seq.num_tokens)
        bm.commit(seq, 1)
        quantise_blocks(pools, bm.compact(seq))


def test_a_prompt_another_sequence_quantised_is_found_whole_while_its_fp16_copies_are_cached():
    """A long shared prompt that A has served and continued past the window is quantised everywhere but
    its sinks. B (same prompt, another ending) finds all of it: the twins for the blocks its first
    recomputed token reads quantised, the cached FP16 copies for the window before that token."""
    pools, bm = _quantised_bm()
    prompt = list(range(100))
    a = new_seq(prompt)
    run(bm, a, pools)
    decode(bm, a, pools, 40)
    assert all(e < 0 for e in a.block_table[1:25])      # the whole shared prompt is quantised
    b = new_seq(prompt + [7] * 12)
    hit = bm.match(b)
    window = (100 - bm.kv.window) // B                   # blocks position 100 reads in FP16 start here
    assert hit[:window] == a.block_table[:window] and len(hit) == 25
    assert all(e >= 0 and bm.cache.get(key) == e for e, key in zip(hit[window:], a.block_keys[window:25]))
    run(bm, b, pools)
    window_start = (b.num_tokens - bm.kv.window) // B
    assert [e < 0 for e in b.block_table] == [0 < i < window_start for i in range(len(b.block_table))]
    bm.free(a)                                           # A finished: its blocks wait in the LRU
    assert bm.match(new_seq(prompt + [9] * 12)) == hit


def test_a_hit_is_cut_where_the_fp16_copies_of_its_window_were_evicted():
    """Preemption frees a sequence's blocks; new work evicts its FP16 copies. Re-admitted, it can reuse
    only a prefix whose window is still in FP16, since its first recomputed token reads that window in
    FP16 in plain decoding: here only the sinks' block."""
    pools, bm = _quantised_bm(num_fp=12)
    a = new_seq(list(range(40)))
    run(bm, a, pools)
    decode(bm, a, pools, 20)                             # 60 tokens: blocks 1..12 quantised
    bm.free(a)                                           # preempted
    other = new_seq([3] * 44)
    run(bm, other, pools)                                # takes every free FP16 block and the LRU's oldest
    bm.free(other)
    assert all(bm.cache.get(key) is None for key in a.block_keys[1:])   # the FP16 copies are gone
    assert bm.match(a) == [bm.cache.get(a.block_keys[0])]


def test_caching_off_shares_nothing():
    bm = BlockManager(KVCacheConfig(block_size=B), 8, 0)
    a = new_seq(list(range(9)))
    run(bm, a)
    bm.free(a)
    assert bm.match(new_seq(list(range(9)))) == [] and bm.usage(False)["free"] == 8


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=2048))


@pytest.mark.slow
def test_a_shared_2k_prefix_cuts_time_to_first_token_and_keeps_the_logits(engine, lee_text):
    text = " ".join(lee_text.read_text().split())
    prefix = engine.encode(text)[:2000]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    first = engine.generate(prefix + engine.encode(" Question one:"), params)     # cold: the whole prompt runs
    second = engine.generate(prefix + engine.encode(" Another question:"), params)
    again = engine.generate(first.prompt_token_ids, params)                       # all but the last block hit
    ratio = second.time_to_first_token_s / first.time_to_first_token_s
    print(f"TTFT cold {first.time_to_first_token_s:.3f}s, 2000-token prefix hit "
          f"{second.time_to_first_token_s:.3f}s, ratio {ratio:.3f}")
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 2 * 2000
    assert ratio < 0.5 and again.time_to_first_token_s < 0.5 * first.time_to_first_token_s
    assert again.token_ids == first.token_ids
    cold, hit = first.logprobs[0], again.logprobs[0]
    assert list(cold) == list(hit)    # the same top 20, in the same order
    assert max(abs(cold[t] - hit[t]) for t in cold) < 1e-4



@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int4_asym", "fp8"])
def test_a_long_document_asked_again_is_found_in_a_quantised_cache(smollm2_engine, lee_text, kv_dtype):
    """Many questions over one long document: A reads it and writes on past the FP16 window, so the whole
    document is quantised; B and C ask other questions, B while A still runs, C after A ended. Each finds
    the document in the cache (all of it up to its own recent window) and picks the token an uncached
    run picks, with log-probabilities as close as a change of prefill chunk size moves them (the cached
    run's K/V after the hit are computed beside quantised neighbours; an uncached run's beside FP16 ones).
    A 32-token window keeps it short: 20 blocks of document, quantised once A is 48 tokens past it."""
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", kv_cache_dtype=kv_dtype,
                                    kv_window=32, chunked_prefill_size=128))
    lines = lee_text.read_text().splitlines()
    document = engine.encode(" ".join(" ".join(lines[:20]).split()))[:320]
    questions = [engine.encode(" ".join(line.split()))[:48] for line in lines[200:202]]
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    writer = engine.stream(document, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(48):                         # A is past the document by more than its window, still running
        next(writer)
    assert all(e < 0 for e in engine.core.scheduler.running[0].block_table[1:20])   # the document is quantised
    asked = []
    for question in questions:
        hits = engine.stats().prefix_hit_tokens
        asked.append(engine.generate(document + question, greedy))
        assert engine.stats().prefix_hit_tokens - hits == len(document)
        writer.close()

    for out in asked:
        engine.reset_prefix_cache()             # nothing cached: this run computes the whole prompt
        hits = engine.stats().prefix_hit_tokens
        cold = engine.generate(out.prompt_token_ids, greedy)
        assert engine.stats().prefix_hit_tokens == hits and cold.token_ids == out.token_ids
        assert max(abs(cold.logprobs[0][t] - out.logprobs[0][t]) for t in cold.token_ids) < 0.1
