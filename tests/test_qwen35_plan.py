"""Qwen3.5's memory plan: weights, the full-attention layers' KV x context, and a recurrent state per sequence
that does not grow with the context; each group's line printed, and the shipped Qwen3.5-9B config at its
native 262,144 tokens on an 8 GB card."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kernels import triton_ops
from bie_trt.kv.pool import allocate_kv
from bie_trt.kv.recurrent import allocate_recurrent
from bie_trt.plan import deltanet_workspace_bytes, solve_plan
from bie_trt.profiles import load_profile
from qwen35_tiny import TINY_QWEN35

CONFIG = Path(__file__).resolve().parents[1] / "docs" / "examples" / "qwen3.5-9b.config.json"


def qwen35_9b() -> ModelConfig:
    return ModelConfig.from_hf(json.loads(CONFIG.read_text()), str(CONFIG))


def test_the_9b_config_reads_as_published():
    cfg = qwen35_9b()
    assert (cfg.num_layers, len(cfg.linear_layers), cfg.linear_layers[:3]) == (32, 24, (0, 1, 2))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads, cfg.max_positions) == (256, 64, 4, 262144)
    assert cfg.rope_theta == 10_000_000 and not cfg.tie_word_embeddings and cfg.eos_token_ids == (248044,)


def test_9b_at_its_native_context_fits_an_8gb_card():
    r = CliRunner().invoke(main, ["plan", "--model-config", str(CONFIG), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "262144"])
    assert r.exit_code == 0, r.output
    assert "fits" in r.stdout and "the largest max_model_len that fits is 262,144" in r.stdout
    # each cache group's line: the full layers' KV, and the recurrent state
    assert "int4_asym, 16,384 blocks x 8 full-attention layers" in r.stdout
    assert "recurrent_state        49.1 MiB  1 seq(s) x 49.1 MiB" in r.stdout
    assert "recurrent_snapshots    98.2 MiB  2 saved state(s)" in r.stdout
    assert "24 of 32 keep a fixed state per sequence" in r.stdout
    assert "total                  7.29 GiB" in r.stdout
    # the cache groups block: 2.25 GiB quantised + 26 FP16 blocks of 8 layers; 3 x 49.1 MiB of state
    assert "full_attention      8 layers    2.26 GiB" in r.stdout
    assert "linear_attention   24 layers   147.4 MiB" in r.stdout


@pytest.mark.parametrize("size,total,layers", [("4b", "5.31", 32), ("2b", "2.61", 24), ("0.8b", "1.95", 24)])
def test_the_smaller_qwen35_models_plan_their_native_context(size, total, layers):
    path = CONFIG.with_name(f"qwen3.5-{size}.config.json")
    cfg = ModelConfig.from_hf(json.loads(path.read_text()), str(path))
    assert cfg.num_layers == layers and len(cfg.linear_layers) == layers * 3 // 4 and cfg.tie_word_embeddings
    r = CliRunner().invoke(main, ["plan", "--model-config", str(path), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "262144", "--json"])
    plan = json.loads(r.stdout)
    assert plan["fits"] and f"{plan['total_bytes'] / 2**30:.2f}" == total


def test_cache_group_bytes_by_hand():
    """Each group's bytes from its own arithmetic: the full layers' INT4 body and FP16 blocks, the state of every
    running sequence and snapshot (2 a sequence by default) over the linear layers."""
    cfg, ti = qwen35_9b(), load_profile("rtx4060ti-8gb")
    kv = KVCacheConfig(dtype="int4_asym")
    plan = solve_plan(cfg, ti, max_model_len=65536, kv=kv, max_num_seqs=2)
    groups = {g.kind: g for g in plan.groups}
    assert list(groups) == ["full_attention", "linear_attention"]
    quant_block = 16 * 8 * 2 * 4 * (256 // 2 + 256 // 64 * 4)      # tokens x layers x K,V x heads x bytes
    fp_block = 16 * 8 * 2 * 4 * 256 * 2
    assert groups["full_attention"].layers == 8
    assert groups["full_attention"].bytes == plan.num_quant_blocks * quant_block + plan.num_fp_blocks * fp_block
    state = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert groups["linear_attention"].layers == 24 and groups["linear_attention"].bytes == (2 + 2 * 2) * state
    assert plan.to_dict()["cache_groups"][1]["items"] == ["recurrent_state", "recurrent_snapshots"]
    assert solve_plan(cfg, ti, max_model_len=4096, kv=kv, state_snapshots=0).bytes_of("recurrent_snapshots") == 0


def test_9b_bytes_by_hand():
    """Only the 8 full-attention layers pay per token (INT4: 4 KV heads x 256 channels, K and V, half a byte
    each plus an fp16 scale and zero per 64 channels); the state is 24 x (conv 8,192 channels x 3 inputs fp16
    + 32 heads x 128 x 128 fp32) per sequence; the linears are the model's 6.92e9 weights at 4 bits plus
    group-128 scales and zeros."""
    cfg, ti = qwen35_9b(), load_profile("rtx4060ti-8gb")
    short, long = (solve_plan(cfg, ti, max_model_len=n, kv=KVCacheConfig(dtype="int4_asym"), max_num_seqs=2)
                   for n in (4096, 262144))
    assert long.kv_bytes_per_token == 8 * 2 * 4 * (256 // 2 + 256 // 64 * 4)
    state = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert short.bytes_of("recurrent_state") == long.bytes_of("recurrent_state") == 2 * state
    assert long.bytes_of("kv_quant_pool") > 60 * short.bytes_of("kv_quant_pool")
    full = 4096 * (2 * 4096) + 2 * 4096 * 1024 + 4096 * 4096
    deltanet = 4096 * (8192 + 4096 + 2 * 32) + 4096 * 4096
    mlp = 3 * 4096 * 12288
    params = 8 * (full + mlp) + 24 * (deltanet + mlp)
    assert params == 6_918_504_448   # with the two 248,320-row tables: 8.95e9, the text model's published size
    groups = params // 128
    assert long.bytes_of("linear_weights") == params // 2 + groups * 2 + groups // 2


def test_plan_items_equal_the_allocated_tensors():
    """What the plan prices is what the pools and the state slots allocate (fp16 activations)."""
    cfg, kv = ModelConfig.from_hf(TINY_QWEN35), KVCacheConfig(dtype="int4_asym", group_size=32)
    plan = solve_plan(cfg, load_profile("cpu"), max_model_len=512, kv=kv, max_num_seqs=3, chunked_prefill_size=64,
                      weight_group_size=32)
    pools = allocate_kv(cfg, kv, plan.num_fp_blocks, plan.num_quant_blocks, 0)
    assert pools.nbytes() == {"fp16": plan.bytes_of("kv_fp16_pool"), "quant": plan.bytes_of("kv_quant_pool")}
    assert allocate_recurrent(cfg, 3, torch.float16).nbytes() == plan.bytes_of("recurrent_state")
    assert allocate_recurrent(cfg, 3, torch.float16, num_snapshots=6).nbytes() == \
        plan.bytes_of("recurrent_state") + plan.bytes_of("recurrent_snapshots")


def test_the_deltanet_phase_is_the_9bs_activation_peak():
    cfg, ti = qwen35_9b(), load_profile("rtx4060ti-8gb")
    plan = solve_plan(cfg, ti, max_model_len=8192, kv=KVCacheConfig(dtype="int4_asym"))
    t = 512 + 1   # solve_plan's default chunk beside one decode
    residual = (t * 4096 + 2 * t * 256) * 2
    mlp = (t * 4096 + 2 * t * 12288 + t * 12288 + t * 4096) * 2
    deltanet = t * (8192 + 4096 + 64 + 8192) * 2 + (2 * t * 32 + 2 * t * 4096 + 3 * t * 4096) * 4
    assert deltanet > mlp and plan.bytes_of("activations") == residual + deltanet == deltanet_workspace_bytes(
        cfg, t) + residual


@pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")
def test_the_deltanet_formula_matches_a_measured_block(monkeypatch):
    """The peak of tensors a DeltaNet sub-block allocates over a 48-token chunk, with the delta rule in its
    Triton kernel (interpreted) as on the GPU, is the formula's within 10% (fp32 activations, weights warm)."""
    from bie_trt.kernels import ops
    from bie_trt.kernels.step_inputs import SeqInput
    from bie_trt.kernels.triton_delta_rule import delta_rule_slots_triton
    from bie_trt.model import llama
    from qwen35_tiny import engine_model, hf_tiny_qwen35
    from test_plan_workspace import PeakTensorBytes

    monkeypatch.setattr(ops, "gated_delta_rule", delta_rule_slots_triton)
    model, pools = engine_model(hf_tiny_qwen35())
    slot, ids, table = pools.recurrent.allocate(), torch.randint(0, 256, (48,)), list(range(16))
    model.forward([SeqInput(ids, 0, table, state_slot=slot)], pools)   # warm-up: the dense weights are kept
    peaks = []

    def metered(*args):
        with PeakTensorBytes() as meter:
            out = block(*args)
        peaks.append(meter.peak)
        return out

    block = llama.deltanet_block
    monkeypatch.setattr(llama, "deltanet_block", metered)
    model.forward([SeqInput(ids, 48, table, state_slot=slot)], pools)
    formula = deltanet_workspace_bytes(model.cfg, 48, dtype_bytes=4)
    assert len(peaks) == 2 and all(0.9 * formula <= p <= 1.1 * formula for p in peaks), (peaks, formula)


def test_the_readme_row_states_what_the_9b_plans():
    r = CliRunner().invoke(main, ["plan", "--model-config", str(CONFIG), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "262144", "--json"])
    plan = json.loads(r.stdout)
    readme = (CONFIG.parents[2] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| Qwen3.5-9B"))
    total, budget = (f"{plan[k] / 2**30:.2f}" for k in ("total_bytes", "budget_bytes"))
    assert f"262,144 (its native context) on `rtx4060ti-8gb`: {total} of {budget} GiB planned" in row
    assert f"plans Qwen3.5-9B at its native 262,144 tokens in {total} of {budget} GiB" in readme.replace("\n", " ")
