"""A cache group per layer type (hybrid sliding-window models, Gemma 3): the sliding layers' blocks stay
bounded by their window while the full layers' grow with the context, the memory plan counts each layer type
apart with the runtime's own formula, a prefix hit needs the sliding blocks of the window at its end, and
/metrics shows the sliding pool apart.

Default suite: pure arithmetic, the block manager alone, and the tiny random Gemma 3 (window 24, blocks of
16) shared with tests/test_gemma3_vs_transformers.py. Slow: a 4,096-token generation."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bie_trt.builder.build import BuildOptions, resolve_kv
from bie_trt.builder.key_centering import CALIBRATION_TEXT
from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig, ModelConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.cache_tiers.cache_file import CacheFileError
from bie_trt.executor.disk_blocks import open_disk_tier
from bie_trt.executor.engine import BieEngine
from bie_trt.executor.sequence import Sequence
from bie_trt.cache_tiers.sliding_blocks import PAD, SlidingBlocks
from bie_trt.kv.pool import allocate_kv
from bie_trt.kv.sizing import kv_pool_blocks, sliding_blocks_per_seq, sliding_pool_blocks
from bie_trt.plan import solve_plan
from bie_trt.profiles import load_profile
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams
from bie_trt.server.metrics import Metrics
from tiny_model import TINY_GEMMA3, write_tiny_hf

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
WINDOW, B = 24, 16   # the tiny Gemma 3's window and the block size
DECODE_BOUND = math.ceil(WINDOW / B) + 1


def gemma_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((EXAMPLES / name).read_text()))


def tiny_hybrid(window: int = WINDOW, layers: tuple[str, ...] = ("sliding_attention",) * 2 + ("full_attention",)
                ) -> ModelConfig:
    return ModelConfig(architecture="Gemma3ForCausalLM", hidden_size=64, intermediate_size=128,
                       num_layers=len(layers), num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=512,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8192, tie_word_embeddings=True,
                       sliding_window=window, layer_types=layers)


def held(blocks: BlockManager, seq: Sequence) -> list[int]:
    """Block indices of seq's sliding table that it holds (not PAD)."""
    return list(range(seq.sliding_first, len(seq.sliding_table)))


# --- the arithmetic ---------------------------------------------------------------------------

def test_sliding_blocks_per_seq_is_window_plus_a_block_plus_a_chunk():
    kv = KVCacheConfig(block_size=B)
    assert sliding_blocks_per_seq(tiny_hybrid(), kv, 512, 32) == 2 + 1 + 2
    assert sliding_blocks_per_seq(tiny_hybrid(), kv, 40, 32) == 3          # never more than the context
    assert sliding_blocks_per_seq(gemma_config("gemma-3-4b-it-awq.config.json"), kv, 131_072, 256) == 64 + 1 + 16
    dense = dataclasses.replace(tiny_hybrid(), layer_types=())
    assert sliding_blocks_per_seq(dense, kv, 512, 32) == 0 and sliding_pool_blocks(dense, kv, 512, 4, 32) == 0


@pytest.mark.parametrize("window", [1, 15, 16, 17, 24, 40])
def test_the_per_sequence_bound_covers_every_step_and_no_row_reads_below_its_window(window):
    """Every step from position c over n <= chunk rows: the blocks its rows read (from the first row's window
    to the last row) fit the bound, and first_read is exactly the block of position c - window + 1."""
    chunk = 32
    sliding = SlidingBlocks(window, B, 0, False)
    bound = sliding_blocks_per_seq(tiny_hybrid(window), KVCacheConfig(block_size=B), 10_000, chunk)
    for c in range(0, 200):
        assert sliding.first_read(c) == max(0, c - window + 1) // B
        for n in range(1, chunk + 1):
            assert -(-(c + n) // B) - sliding.first_read(c) <= bound


def test_the_plan_counts_each_layer_type_with_the_runtimes_formula():
    model, kv = tiny_hybrid(), KVCacheConfig(dtype="int4_asym", group_size=32, block_size=B)
    plan = solve_plan(model, load_profile("cpu"), max_model_len=512, kv=kv, max_num_seqs=3,
                      chunked_prefill_size=32, weight_group_size=32)
    n_fp, n_q = kv_pool_blocks(model, kv, 512, 3, 32)
    n_sliding = sliding_pool_blocks(model, kv, 512, 3, 32)
    assert (plan.num_fp_blocks, plan.num_quant_blocks, plan.num_sliding_blocks) == (n_fp, n_q, n_sliding)
    assert n_sliding == 3 * (2 + 1 + 2) and n_q == 3 * 32
    pools = allocate_kv(model, kv, n_fp, n_q, n_sliding, dtype=torch.float16, device="meta")
    assert pools.k.shape[0] == 1 and pools.sliding.k.shape[0] == 2   # one full layer, two sliding ones
    assert pools.nbytes() == {"fp16": plan.bytes_of("kv_fp16_pool"), "quant": plan.bytes_of("kv_quant_pool"),
                              "sliding": plan.bytes_of("kv_sliding_pool")}
    # the full layer alone grows with the context: 32 more blocks of context cost one layer's INT4 blocks
    longer = solve_plan(model, load_profile("cpu"), max_model_len=1024, kv=kv, max_num_seqs=3,
                        chunked_prefill_size=32, weight_group_size=32)
    assert longer.bytes_of("kv_sliding_pool") == plan.bytes_of("kv_sliding_pool")
    assert longer.bytes_of("kv_quant_pool") == 2 * plan.bytes_of("kv_quant_pool")


def test_gemma_3_4b_fits_131072_tokens_on_8_gb_far_below_34_full_layers():
    profile = load_profile("rtx4060ti-8gb")
    four_b = gemma_config("gemma-3-4b-it-awq.config.json")
    kv, chunk = profile.defaults.kv_config(four_b), profile.defaults.chunked_prefill_size   # bie-trt plan's defaults
    plan = solve_plan(four_b, profile, max_model_len=131_072, kv=kv, chunked_prefill_size=chunk)
    assert plan.fits and plan.max_model_len_that_fits == 131_072
    kv_bytes = sum(it.bytes for it in plan.items if it.name.startswith("kv_")
                   and it.name not in ("kv_key_mean", "kv_key_scale"))
    assert plan.all_full["kv_bytes"] > 5 * kv_bytes
    assert "kv_sliding_pool" in plan.format_table() and "with all 34 layers full" in plan.format_table()
    twelve = solve_plan(gemma_config("gemma-3-12b-it-awq.config.json"), profile, max_model_len=8192, kv=kv,
                        chunked_prefill_size=chunk)
    assert twelve.max_model_len_that_fits > 2 * twelve.all_full["max_model_len_that_fits"]


# --- the KV format a Gemma 3 build takes -------------------------------------------------------

def test_a_gemma_3_build_takes_key_centering_and_a_512_token_window_unless_told_otherwise(tiny_gemma3_engine):
    """Gemma 3's full layers need both to keep INT4 within +0.5% perplexity of FP16 (docs/kv-cache-quality.md)."""
    manifest = json.loads((Path(tiny_gemma3_engine.config.engine_dir) / "manifest.json").read_text())
    assert (manifest["kv"]["key_centering"], manifest["kv"]["window"], manifest["kv"]["group_size"]) == (True, 512, 64)
    profile, gemma = load_profile("cpu"), tiny_hybrid()
    told = resolve_kv(BuildOptions("x", "y", kv_key_centering=False, kv_window=128), profile, gemma)
    assert (told.key_centering, told.window) == (False, 128)
    llama = dataclasses.replace(gemma, architecture="LlamaForCausalLM", sliding_window=None, layer_types=None)
    other = resolve_kv(BuildOptions("x", "y"), profile, llama)
    assert (other.key_centering, other.window) == (False, profile.defaults.kv_window) == (False, 128)


def test_bie_trt_plan_holds_gemma_3s_512_token_fp16_window():
    config = str(EXAMPLES / "gemma-3-4b-it-awq.config.json")

    def plan(*options: str) -> dict:
        r = CliRunner().invoke(main, ["plan", "--model-config", config, "--profile", "rtx4060ti-8gb", "--json", *options])
        return json.loads(r.stdout)

    gemma, told = plan(), plan("--kv-window", "128")
    assert (gemma["inputs"]["kv"]["window"], gemma["inputs"]["kv"]["key_centering"]) == (512, True)
    # the FP16 pool holds the window: 384 more tokens are 24 more blocks of 16
    assert (gemma["num_fp_blocks"], told["num_fp_blocks"]) == (50, 26)
    assert gemma["kv_bytes_per_token"] == told["kv_bytes_per_token"] == 5 * 4 * 2 * (256 // 2 + 256 // 64 * 4)


# --- the block manager alone ------------------------------------------------------------------

def new_seq(n: int, offset: int = 0) -> Sequence:
    return Sequence([offset + t for t in range(n)], SamplingParams(), make_generator(SamplingParams(), 0))


def run_prefill(blocks: BlockManager, seq: Sequence, chunk: int) -> None:
    """The scheduler's bookkeeping of a prefill in chunks (no forward): grow, commit, slide."""
    while seq.num_cached < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_cached)
        assert seq.sliding_first == blocks.sliding.first_read(seq.num_cached)   # nothing the next row reads is gone
        blocks.grow(seq, seq.num_cached + n)
        assert len(held(blocks, seq)) <= DECODE_BOUND + math.ceil(chunk / B)
        blocks.commit(seq, n)
        blocks.compact(seq)


def test_a_prefix_hit_needs_the_sliding_blocks_of_the_window_at_its_end():
    kv = KVCacheConfig(block_size=B)
    blocks = BlockManager(kv, 64, 0, enable_prefix_caching=True, sliding_window=WINDOW, num_sliding_blocks=64)
    first = new_seq(100)
    blocks.admit(first, blocks.match(first))
    run_prefill(blocks, first, 32)
    assert held(blocks, first) == [4, 5, 6]   # the next row, 100, reads 77.. (block 4)
    assert all(first.sliding_table[b] == PAD for b in range(4))
    blocks.free(first)
    # blocks 0..5 are full and cached (0..3 given back as they slid out, then 5 and 4 at the end)
    assert blocks.sliding.usage() == {"used": 0, "cached": 6, "free": 58}
    for _ in range(4):   # the oldest, 0..3: a hit at 6 blocks reads only 4 and 5 (the row at 96 reads 73..)
        blocks.sliding.cache.evict(False)
    again = new_seq(100)
    hit = blocks.match(again)
    assert len(hit) == 6 and blocks.can_admit(hit, 100, again)
    blocks.admit(again, hit)
    assert held(blocks, again) == [4, 5] and again.num_cached == 96
    blocks.free(again)
    blocks.sliding.cache.evict(False)   # block 5 (freed tail first, so the older of the two): no window is whole
    assert blocks.match(new_seq(100)) == []


def test_admission_counts_the_parked_window_blocks_a_hit_takes():
    """A hit's window blocks parked in the LRU count as free until the hit takes them: admission needs them
    and the new blocks both, so a pool one block short refuses the sequence (admitting it would run out of
    blocks at its first step), and once the pool has room the admission takes exactly what it asked for."""
    kv = KVCacheConfig(block_size=B)
    blocks = BlockManager(kv, 64, 0, enable_prefix_caching=True, sliding_window=WINDOW, num_sliding_blocks=8)
    first = new_seq(100)
    blocks.admit(first, blocks.match(first))
    run_prefill(blocks, first, 32)
    blocks.free(first)
    sliding = blocks.sliding
    for _ in range(4):   # blocks 0..3 evicted (as an allocation would), 4 and 5 left parked: the window a hit at 6 reads
        sliding.free.append(sliding.cache.evict(False))
    other = new_seq(64, offset=5000)
    blocks.admit(other, blocks.match(other))
    blocks.grow(other, 64)
    assert sliding.usage() == {"used": 4, "cached": 2, "free": 2}
    again = new_seq(140)   # the first prompt's 100 tokens and 40 more: a hit of 6 blocks, then 3 new blocks
    hit = blocks.match(again)
    assert len(hit) == 6 and sliding.admission_need(blocks.prompt_keys(again), 6, 140) == 2 + 3 > sliding.num_free == 4
    assert not blocks.can_admit(hit, 140, again)
    blocks.free(other)
    assert blocks.can_admit(hit, 140, again)
    free = sliding.num_free
    blocks.admit(again, hit)
    blocks.grow(again, 140)
    assert free - sliding.num_free == 5 and held(blocks, again) == [4, 5, 6, 7, 8]


# --- the tiny Gemma 3 -------------------------------------------------------------------------

def prompt(engine: BieEngine, n: int) -> list[int]:
    ids = engine.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:n]
    assert len(ids) == n
    return ids


def record_steps(engine: BieEngine, monkeypatch) -> list[tuple[int, int, int, int]]:
    """After each schedule (the step's blocks taken, before its forward): (first position, rows, sliding blocks
    in use, full-layer blocks in use) of the one running sequence, read from the block manager."""
    steps = []
    schedule = engine.core.scheduler.schedule

    def recording():
        batch = schedule()
        (seq, n), = batch.chunks
        steps.append((seq.num_cached, n + batch.lookahead.get(seq, 0), engine.core.blocks.sliding.usage()["used"],
                      engine.core.blocks.usage(False)["used"]))
        return batch

    monkeypatch.setattr(engine.core.scheduler, "schedule", recording)
    return steps


def assert_bounded(steps: list[tuple[int, int, int, int]], window: int) -> None:
    """Each step holds exactly the sliding blocks its rows read: from the block of its first row's window to its
    last row (<= the window and a block, plus the chunk's blocks), while the full layers hold the context."""
    for c, n, sliding, full in steps:
        assert sliding == -(-(c + n) // B) - max(0, c - window + 1) // B, (c, n, sliding)
        assert sliding <= math.ceil(window / B) + 1 + math.ceil((n - 1) / B)
        assert full == -(-(c + n) // B)


def test_sliding_blocks_stay_bounded_while_the_full_layers_grow(tiny_gemma3_engine, monkeypatch):
    engine = tiny_gemma3_engine
    engine.reset_prefix_cache()
    monkeypatch.setattr(engine.core.scheduler, "chunked_prefill_size", 32)   # the prompt in 4 chunks
    steps = record_steps(engine, monkeypatch)
    out = engine.generate(prompt(engine, 100), SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    assert len(out.token_ids) == 300 and [n for _, n, _, _ in steps[:4]] == [32, 32, 32, 4]
    assert_bounded(steps, WINDOW)
    assert max(s for _, n, s, _ in steps if n == 1) == DECODE_BOUND and steps[-1][3] == -(-399 // B)
    metrics = Metrics(engine.stats).render().decode()
    assert 'bie_kv_blocks{pool="sliding",state="used"} 0.0' in metrics   # given back, apart from the full layers'
    assert 'bie_kv_blocks{pool="sliding",state="cached"}' in metrics and 'bie_kv_blocks{pool="fp16"' in metrics


def test_a_hit_inside_an_earlier_prompt_shares_its_slid_out_blocks_exactly(tiny_gemma3_engine):
    """B shares 200 tokens with A: its hit lands where A's sliding blocks had already slid out (kept cached),
    and its tokens equal a cold run's."""
    engine = tiny_gemma3_engine
    a = prompt(engine, 300)
    b = a[:200] + prompt(engine, 40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.reset_prefix_cache()
    cold = engine.generate(b, params)
    engine.reset_prefix_cache()
    engine.generate(a, params)
    warm = engine.generate(b, params)
    assert warm.usage.cached_tokens == 192 and warm.token_ids == cold.token_ids


def test_the_engines_admission_asks_for_the_sliding_blocks_its_first_step_takes(tiny_gemma3_engine, monkeypatch):
    """A prompt that extends one served before: its hit's window blocks wait in the LRU, counted free. What the
    engine's admission asks of the sliding pool (the hit's parked blocks and the first chunk's new ones) is
    what the admitting step then takes from it."""
    engine = tiny_gemma3_engine
    sliding = engine.core.blocks.sliding
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.reset_prefix_cache()
    a = prompt(engine, 300)
    engine.generate(a[:100], params)
    asked, taken = [], []
    blocks = engine.core.blocks
    can_admit, schedule = blocks.can_admit, engine.core.scheduler.schedule

    def asking(hit, num_tokens, seq=None):
        asked.append((sliding.admission_need(blocks.prompt_keys(seq), len(hit), num_tokens), sliding.num_free))
        return can_admit(hit, num_tokens, seq)

    def scheduling():
        batch = schedule()
        taken.append(sliding.num_free)
        return batch

    monkeypatch.setattr(engine.core.blocks, "can_admit", asking)
    monkeypatch.setattr(engine.core.scheduler, "schedule", scheduling)
    out = engine.generate(a[:140], params)
    (need, free), after = asked[0], taken[0]
    assert out.usage.cached_tokens == 96 and need == free - after == 2 + 3   # blocks 4 and 5 parked, 6..8 new


@pytest.mark.slow
def test_sliding_blocks_stay_bounded_over_a_4096_token_generation(build, tmp_path, smollm2_checkpoint, monkeypatch):
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint

    hf = write_tiny_hf(tmp_path / "hf", smollm2_checkpoint, **TINY_GEMMA3, max_position_embeddings=8192)
    awq = quantize_checkpoint(hf, tmp_path / "awq", group_size=32)
    engine = BieEngine(EngineConfig(engine_dir=str(build(checkpoint=str(awq), max_model_len=4608,
                                                         kv_cache_dtype="int4_asym", kv_group_size=32)), device="cpu"))
    steps = record_steps(engine, monkeypatch)
    out = engine.generate(prompt(engine, 100), SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    assert len(out.token_ids) == 4096
    for c, n, sliding, _ in steps:
        assert sliding == -(-(c + n) // B) - max(0, c - WINDOW + 1) // B
    assert max(s for _, n, s, _ in steps if n == 1) == DECODE_BOUND


def test_a_hybrid_engine_keeps_no_host_or_disk_tier_and_refuses_cache_files(tiny_gemma3_engine, tmp_path):
    """The tiers would have to carry the sliding layers' blocks with the full layers' ones: off, and said so."""
    engine = tiny_gemma3_engine
    assert engine.core.blocks.host is None and engine.stats().host_kv["capacity_bytes"] == 0
    config = dataclasses.replace(engine.config, kv_cache_dir=str(tmp_path))
    assert open_disk_tier(config, engine.core.runner, engine.model_name) is None
    with pytest.raises(CacheFileError, match="sliding-window layers"):
        engine.save_cache(prompt(engine, 40), tmp_path / "prompt.kv")
    assert not (tmp_path / "prompt.kv").exists()
