"""The decode step's launch and byte accounting (`scripts/count_step.py`) holds: the counts a step of
the Llama-3-8B structure launches per layer and outside the layers, the tiny model run through the
interpreted kernels launching the same, and the bytes moved against the roofline."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from bie_trt.config import KVCacheConfig
from bie_trt.kernels import triton_ops
from bie_trt.model.synthetic import llama3_8b, qwen3_8b, tiny_llama, tiny_qwen3
from bie_trt.plan import kv_bytes_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import count_step  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")

# What one decode step launches today. Lower these as launches are fused away; a change that adds
# a launch fails here.
LAUNCHES_PER_LAYER = 6
LAUNCHES_OUTSIDE = 3
MAX_BYTES_OVER_ROOFLINE = 1.10
# A speculative verify step (γ+1 rows a sequence), as its CUDA graph records it, launches per layer what a
# decode does, its attention one tiled launch for every row of every sequence, crossing a window block or
# not. Outside: the int32 casts of its query tiles and positions, the fp32 cast of the logits, and the
# norm + int8 head, one launch per 16 rows (then a concatenation).
VERIFY_ROWS = 6
VERIFY_LAUNCHES_OUTSIDE = {1: 4, 4: 6}   # batch 4: 20 or 24 rows, two head launches and the cat
# A draft step: the decode's launches a layer; outside, the staged copy and each sequence's two heads.
DRAFT_LAUNCHES_OUTSIDE = {1: 3, 4: 9}
KV = KVCacheConfig(dtype="int4_asym")


@pytest.fixture(scope="module")
def llama_step():
    return count_step.count(llama3_8b(), KV, 1, 65536)


def test_launch_counts_of_the_8b_structure(llama_step):
    r = llama_step
    assert (r["launches_per_layer"], r["launches_outside"]) == (LAUNCHES_PER_LAYER, LAUNCHES_OUTSIDE)
    assert r["launches_total"] == 32 * LAUNCHES_PER_LAYER + LAUNCHES_OUTSIDE
    names = {x["name"] for x in r["per_layer"]}
    assert "_paged_attention_kernel" in names   # the layer's real work is in the listing
    assert sum(x["count"] for x in r["per_layer"] if x["name"].startswith("_w4_")) >= 4


def test_bytes_against_the_roofline(llama_step):
    r = llama_step
    cfg = llama3_8b()
    # Independent arithmetic: 4-bit weights + an fp16 scale and a 4-bit zero per 128 inputs, the
    # int8 head with a row scale, and 64k tokens of INT4 K and V (codes + fp16 scale and zero per 64).
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    weights = cfg.num_layers * sum(a * b // 2 + (a // 128) * b * 2 + (a // 128) * b // 2 for a, b in linears)
    head = cfg.vocab_size * (h + 2)
    kv_bytes = 65536 * cfg.num_layers * cfg.num_kv_heads * 2 * (cfg.head_dim // 2 + 4 * (cfg.head_dim // 64))
    assert r["roofline_bytes"] == weights + head + kv_bytes
    # The step reads at least the roofline (the runtime stores zeros as whole bytes) and not much more.
    assert r["bytes_read"] >= r["roofline_bytes"]
    assert r["bytes_over_roofline"] <= MAX_BYTES_OVER_ROOFLINE


def test_a_qwen3_step_launches_what_a_llama_step_does():
    """Qwen3-8B (36 layers, q/k head norms): the norms ride in the qkv epilogue, no launch of their own."""
    r = count_step.count(qwen3_8b(), KV, 1, 65536)
    assert r["model"]["qk_norm"] and r["model"]["num_layers"] == 36
    assert (r["launches_per_layer"], r["launches_outside"]) == (LAUNCHES_PER_LAYER, LAUNCHES_OUTSIDE)
    assert r["triton_per_layer"] == LAUNCHES_PER_LAYER
    assert {x["name"]: x["count"] for x in r["per_layer"]}["_qkv_epilogue_kernel"] == 1
    assert r["bytes_over_roofline"] <= MAX_BYTES_OVER_ROOFLINE


@pytest.mark.parametrize("gamma", [4, 5])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("crossing", [False, True], ids=["inside", "crossing"])
def test_launch_counts_of_a_verify_step(gamma, batch, crossing):
    context = count_step.verify_context(gamma + 1, crossing, KV)
    assert context - 65536 < KV.block_size
    r = count_step.count(llama3_8b(), KV, batch, context, rows=gamma + 1)
    assert r["launches_per_layer"] == LAUNCHES_PER_LAYER
    assert sum(x["count"] for x in r["per_layer"] if x["name"] == "_paged_attention_kernel") == 1
    assert r["launches_outside"] == VERIFY_LAUNCHES_OUTSIDE[batch]
    # the rows of every sequence share one read of the weights; each run of a sequence's rows (two when
    # they cross a window block, each through its own view) reads its K/V once
    extra = crossing * batch * context * kv_bytes_per_token(llama3_8b(), KV)
    assert r["bytes_over_roofline"] <= MAX_BYTES_OVER_ROOFLINE * (r["roofline_bytes"] + extra) / r["roofline_bytes"]


@pytest.mark.parametrize("batch", [1, 4])
def test_launch_counts_of_a_draft_step(batch):
    """The Llama-3.2-1B draft's step over its bounded FP16 cache, at later original positions, then its
    static and per-request int8 heads."""
    r = count_step.draft_step(batch)
    assert r["model"]["num_layers"] == 16 and r["kv"]["dtype"] == "fp16"
    assert r["launches_per_layer"] == LAUNCHES_PER_LAYER
    assert r["launches_outside"] == DRAFT_LAUNCHES_OUTSIDE[batch]
    # each sequence's logits take their own launch of the static head, which reads it again
    k, hidden = r["draft_heads"][0], r["model"]["hidden_size"]
    extra = (batch - 1) * k * (hidden + 2)
    assert r["bytes_over_roofline"] <= MAX_BYTES_OVER_ROOFLINE * (r["roofline_bytes"] + extra) / r["roofline_bytes"]


@pytest.mark.parametrize("rows, tiny", [(1, tiny_llama), (1, tiny_qwen3),
                                        pytest.param(VERIFY_ROWS, tiny_llama, marks=pytest.mark.slow)])
def test_shape_only_accounting_equals_an_executed_step(rows, tiny):
    """The tiny model of the same structure with its kernels really run (interpreter) launches what
    the shape-only (meta) accounting of the same model counts."""
    tiny_kv = dataclasses.replace(KV, group_size=32, sink_tokens=4, window=16)
    run = count_step.split_layers(tiny(), tiny_kv, 2, 48, "cpu", rows)
    meta = count_step.split_layers(tiny(), tiny_kv, 2, 48, "meta", rows)
    # fp32 on the CPU has no dtype casts around the fp32 Hadamard product; everything else matches
    for part in ("layer", "outside"):
        assert {k: n for k, n in run[part].items() if k[1] != "_to_copy"} == \
               {k: n for k, n in meta[part].items() if k[1] != "_to_copy"}
    assert run["layer"][("triton", "_paged_attention_kernel")] == 1


def test_the_report_lists_whole_wave_gemv_grids():
    grids = count_step.gemv_grids(llama3_8b())
    assert {"rtx3060", "rtx4060ti", "h200"} <= set(grids)
    for gpu, rows in grids.items():
        for name in ("qkv", "o", "gate_up", "down"):
            g = rows[name]
            assert g["waves"] == pytest.approx(g["programs"] / (rows["sms"] * g["resident_per_sm"]), abs=1e-3)
            assert round(g["waves"]) >= 2 and abs(g["waves"] - round(g["waves"])) <= 0.15, (gpu, name, g)


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.0, marks=pytest.mark.slow)], ids=["sampled", "greedy"])
def test_a_draft_round_draws_its_proposals_without_a_host_sync(tiny_draft_engine, temperature):
    """γ = 5 proposals of the draft at batch 1 and 4, a first round and one after a rejection, its decode steps
    from static steps as on a GPU: nothing the host does between the draft steps waits for the device, and
    the round hands its proposals over with one read after its last step."""
    counted = count_step.draft_syncs(tiny_draft_engine, gamma=5, batches=(1, 4), temperatures=(temperature,))
    kind = "greedy" if temperature == 0 else "sampled"
    assert set(counted) == {f"{kind}_b1", f"{kind}_b4"}
    for name, rounds in counted.items():
        batch = int(name[-1])
        for r in rounds.values():
            assert r["draft_steps"] == 5 and r["proposals"] == [5] * batch, (name, r)
            assert r["graph_steps"] >= 4   # the steps after the first (which reads the new tokens) from static steps
            assert r["syncs_between_steps"] == 0, (name, r)
            assert (r["syncs_after_last_step"], r["syncs_after_last_step_ops"]) == (1, ["tolist"]), (name, r)


def test_a_decode_step_reads_the_device_once(tiny_engine):
    """One engine step of four decoding rows, each with another knob (greedy with a repetition penalty, top-k
    with presence and frequency penalties, min-p with logprobs, logit_bias with min_tokens): outside the forward
    the host waits for the device once, for the sampled ids and logprobs (before: 10, two a row and the
    penalties' unique and the logprobs' read; benchmarks/results/step_syncs_cpu.json)."""
    counted = count_step.step_syncs(tiny_engine, {"mixed": count_step.STEP_BATCHES["mixed"]})
    for name, r in counted.items():
        assert r["batch"] == 4 and (r["syncs"], r["ops"]) == (1, {"tolist": 1}), (name, r)
