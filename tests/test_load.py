"""The load test at CI size: 8 clients for 10 s against a real server through the `openai` client,
with clients hanging up mid-stream and invalid bodies among the requests (each kind from the first
round of requests on). Zero 5xx, every invalid body refused with a 4xx, and the KV blocks back to
idle afterwards. benchmarks/results/ holds a 16-client, 300 s run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_load_test_ci_size(smollm2_engine, tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "scripts/load_test.py", "--engine", str(smollm2_engine), "--clients", "8",
                           "--duration", "10", "--max-model-len", "256", "--max-prompt-words", "60",
                           "--max-tokens", "24", "--out", str(out)],
                          cwd=ROOT, timeout=600, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})   # this tree's bie_trt, not an installed one
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == (0 if result["ok"] else 1)
    assert result["server_errors_5xx"] == 0, result["statuses"]
    assert result["kv_blocks_used_after"] == result["kv_blocks_used_before"] == 0
    outcomes = result["outcomes"]
    assert outcomes.get("completed", 0) > 0 and outcomes.get("disconnected", 0) > 0, outcomes
    assert outcomes.get("invalid_refused", 0) > 0, outcomes
    assert "invalid_accepted" not in outcomes and "connection_error" not in outcomes, outcomes
    assert result["requests"] == sum(outcomes.values()) == sum(result["statuses"].values())
    assert result["ttft_s"]["p50"] <= result["ttft_s"]["p95"] <= result["ttft_s"]["p99"]
    assert result["ok"]
