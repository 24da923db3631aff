"""Gemma 4's memory plan: only the layers that own a cache pay for it (the KV-shared ones read another layer's),
the full layers' wider heads and own KV head count, and the per-layer embedding table in pinned host memory
on the 8 GB profiles; the shipped E4B config at its 131,072-token context on an 8 GB card."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.plan import linear_weight_bytes, solve_plan
from bie_trt.profiles import load_profile

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
E2B, E4B = EXAMPLES / "gemma-4-e2b-it.config.json", EXAMPLES / "gemma-4-e4b-it.config.json"


def read(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(path.read_text()), str(path))


def test_the_e2b_and_e4b_configs_read_as_published():
    e2b, e4b = read(E2B), read(E4B)
    # E2B: four sliding layers to one full; layers 15-34 share the KV of layer 13 (sliding) or 14 (full)
    assert (e2b.num_layers, e2b.first_shared_layer, e2b.kv_source(18), e2b.kv_source(19)) == (35, 15, 13, 14)
    assert (e2b.cache_layers(), e2b.cache_layers(sliding=True)) == (3, 12)
    assert (e2b.intermediate_of(14), e2b.intermediate_of(15)) == (6144, 12288)
    # E4B: five to one, 18 shared layers, the MLP the same width throughout
    assert (e4b.num_layers, e4b.cache_layers(), e4b.cache_layers(sliding=True), e4b.kv_source(41)) == (42, 4, 20, 23)
    assert e4b.cache_shape() == (2, 512) and e4b.cache_shape(sliding=True) == (2, 256)
    assert e4b.window_of(0) == 512 and e4b.global_rope_proportion == 0.25 and e4b.local_rope_theta == 10_000
    assert e4b.final_logit_softcapping == 30.0 and e4b.eos_token_ids == (1, 106) and not e4b.attention_k_eq_v


def test_e4b_at_131072_fits_an_8gb_card_with_its_per_layer_table_on_the_host():
    r = CliRunner().invoke(main, ["plan", "--model-config", str(E4B), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "131072"])
    assert r.exit_code == 0, r.output
    assert "the largest max_model_len that fits is 131,072" in r.stdout
    assert "per_layer_embedding           0 B  pinned host memory (5.25 GiB); only 21,504 bytes/token" in r.stdout
    assert "int4_asym, 8,192 blocks x 4 full-attention layers" in r.stdout
    assert "x 20 sliding layers" in r.stdout and "18 KV-shared layers own no cache" in r.stdout


def test_bytes_by_hand():
    """A token costs the 4 owning full layers' INT4 K and V (2 heads x 512 channels, half a byte each plus an
    fp16 scale and zero per 64 channels), not the 7 full layers'; on a profile whose embedding stays on the
    device the per-layer table is there too, [262,144, 42 x 256] fp16. A shared layer has no k or v linears."""
    cfg = read(E4B)
    plan = solve_plan(cfg, load_profile("rtx4060ti-8gb"), max_model_len=8192, kv=KVCacheConfig(dtype="int4_asym"),
                      embedding_placement="gpu")
    assert plan.kv_bytes_per_token == 4 * 2 * 2 * (512 // 2 + 512 // 64 * 4)
    assert plan.bytes_of("per_layer_embedding") == 262_144 * 42 * 256 * 2
    # 20 + 4 owning sliding and full layers, 15 + 3 shared ones (q and o only), every MLP the same
    h, q_sliding, kv_sliding, q_full, kv_full, i = 2560, 8 * 256, 2 * 256, 8 * 512, 2 * 512, 10240
    weights = (20 * (h * (q_sliding + 2 * kv_sliding) + q_sliding * h) + 4 * (h * (q_full + 2 * kv_full) + q_full * h)
               + 15 * (h * q_sliding + q_sliding * h) + 3 * (h * q_full + q_full * h) + 42 * 3 * h * i)
    # 4 bits a weight; an fp16 scale and a 4-bit zero per 128 inputs of each output
    assert linear_weight_bytes(cfg, 128) == weights // 2 + weights // 128 * 5 // 2


TWELVE_B = EXAMPLES / "gemma-4-12b-it.config.json"


def test_the_12b_reads_as_published_and_fits_32768_tokens_on_an_8gb_card():
    """The 12B (Gemma4Unified): no per-layer embeddings and no KV sharing, K = V on its 8 full layers of one
    512-wide KV head, a 1,024-token window on the 40 sliding ones; at 32,768 tokens it fits an 8 GB card with
    its keys uncentred (no mean key: the two kinds' keys differ in shape)."""
    cfg = read(TWELVE_B)
    assert (cfg.family, cfg.num_layers, cfg.per_layer_input_size, cfg.num_kv_shared_layers) == ("gemma4", 48, 0, 0)
    assert cfg.cache_shape() == (1, 512) and cfg.cache_shape(sliding=True) == (8, 256) and cfg.k_eq_v_at(5)
    assert (cfg.cache_layers(), cfg.cache_layers(sliding=True), cfg.window_of(0)) == (8, 40, 1024)
    r = CliRunner().invoke(main, ["plan", "--model-config", str(TWELVE_B), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "32768"])
    assert r.exit_code == 0, r.output
    assert "fits," in r.stdout and "the largest max_model_len that fits is 37,824" in r.stdout, r.stdout
    assert "kv_key_mean             0 B  none: key centering is off" in r.stdout
    assert "per_layer_embedding" not in r.stdout
