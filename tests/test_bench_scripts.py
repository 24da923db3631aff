"""The GPU benchmark scripts run end to end before any GPU is lent: `--smoke` takes the same code
paths on a tiny model, and the numbers it writes follow from the shapes by independent arithmetic."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bie_trt.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_bench_decode_smoke(tmp_path):
    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, "scripts/bench_decode.py", "--smoke", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    cfg, group = ModelConfig.from_dict(result["model"]), result["weight_group_size"]
    rows = {(r["kv"], r["context"]): r for r in result["decode"]}
    assert set(rows) == {(kv, ctx) for kv in ("int4_asym", "fp16") for ctx in (256, 512)}

    # bytes a decode step reads: 4-bit weights with an fp16 scale and a uint8 zero per group of
    # inputs, the int8 lm_head with an fp16 scale per row, and every cached token's K and V
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    linears = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    weights = cfg.num_layers * sum(n * k // 2 + 3 * n * k // group for n, k in linears) + cfg.vocab_size * (h + 2)
    per_token = {"fp16": 2 * d * 2,                  # K and V, fp16
                 "int4_asym": 2 * (d // 2 + 4 * (d // 64))}  # 4-bit codes, fp16 scale and zero per 64 channels
    for (dtype, ctx), r in rows.items():
        expected = weights + ctx * cfg.num_layers * cfg.num_kv_heads * per_token[dtype]
        assert r["bytes_per_token"] == expected
        assert r["tokens_per_s"] > 0
        assert r["roofline_fraction"] == pytest.approx(r["tokens_per_s"] * expected / result["bandwidth"])
        assert r["plan_gib"] > 0
    prefill = result["prefill"]
    assert prefill["prompt_tokens"] == 512 and prefill["seconds"] > 0


def test_random_awq_checkpoint_builds_and_generates(tmp_path):
    """The full-scale stand-in checkpoint (here with tiny shapes) is a valid AWQ checkpoint end to end."""
    from bie_trt import BieEngine, EngineConfig, SamplingParams
    from bie_trt.builder.build import BuildOptions, build_engine

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
                                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "vocab_size": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                                  "rope_theta": 10000.0, "tie_word_embeddings": False}))
    ckpt = tmp_path / "ckpt"
    subprocess.run([sys.executable, "scripts/random_awq_checkpoint.py", "--out", str(ckpt), "--config", str(config),
                    "--group-size", "64"], cwd=ROOT, check=True, timeout=300, capture_output=True)
    engine = build_engine(BuildOptions(checkpoint=str(ckpt), out=str(tmp_path / "engine"), profile="cpu",
                                       max_model_len=256), log=lambda m: None)
    out = BieEngine(EngineConfig(engine_dir=str(engine), device="cpu")).generate(
        "the cat is on a mat", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.slow
def test_bench_eval_times_the_eval_command_and_the_reference(tmp_path, smollm2_engine):
    from bie_trt.engine_format import read_manifest
    from bie_trt.eval_texts import load_eval_text, text_token_ids
    from bie_trt.evaluate import evaluate

    out = tmp_path / "eval.json"
    subprocess.run([sys.executable, "scripts/bench_eval.py", "--engine", str(smollm2_engine), "--context", "48",
                    "--reference-runs", "1", "--out", str(out)], cwd=ROOT, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    # the numbers are the eval command's own: the same as the library's for that window
    kv = dataclasses.replace(read_manifest(smollm2_engine).kv, dtype="int4_asym")
    ids = text_token_ids(smollm2_engine, load_eval_text("builtin:python-docs"))
    expected = evaluate(smollm2_engine, ids, 48, {kv.dtype: kv}, max_windows=1, progress=False)
    # (the test process and the command may run different torch thread counts: the KL sums' last bits follow it)
    assert [(r["label"], r["ppl"], pytest.approx(r["kld"], rel=1e-9, abs=0)) for r in result["eval"]["rows"]] == \
        [(r.label, r.ppl, r.kld) for r in expected]
    assert result["eval"]["seconds"] > 0 and result["reference_fp32_forward"]["seconds"] > 0
    assert result["ratio"] == round(result["eval"]["seconds"] / result["reference_fp32_forward"]["seconds"], 2)


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_bench_step_costs_smoke(tiny_draft_engine, tmp_path):
    """The step-cost benchmark on the tiny engine: each context and row count timed, each relative to the plain
    step at the same context; a context the engine cannot hold is refused, naming the fix."""
    out = tmp_path / "costs.json"
    run = [sys.executable, "scripts/bench_step_costs.py", "--engine", str(tiny_draft_engine), "--rows", "3",
           "--repeats", "2", "--warmup", "1", "--out", str(out)]
    subprocess.run(run + ["--contexts", "16,40"], cwd=ROOT, check=True, timeout=300, capture_output=True)
    steps = json.loads(out.read_text())["steps"]
    assert [s["context"] for s in steps] == [16, 40]
    for s in steps:
        assert set(s["ms"]) == {"1", "2", "3"} and all(ms > 0 for ms in s["ms"].values())
        assert s["per_plain"] == {r: pytest.approx(ms / s["ms"]["1"], abs=2e-3) for r, ms in s["ms"].items()}
    refused = subprocess.run(run + ["--contexts", "100000"], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert refused.returncode != 0 and "--max-model-len" in refused.stderr
