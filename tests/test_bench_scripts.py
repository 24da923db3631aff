"""The GPU benchmark scripts run end to end before any GPU is lent: `--smoke` takes the same code
paths on a tiny model, and the numbers it writes follow from the shapes by independent arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bie_trt.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


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
