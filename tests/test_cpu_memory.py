"""CPU memory at 8B scale: the build's one forward pass (the key calibration) keeps memory near one
layer's dequantised weights, and the CPU runtime keeps every layer's (4 bytes a weight: 28 GB for an
8B) only when half the available memory holds them; otherwise it streams them, to the same logits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bie_trt.config import EngineConfig
from bie_trt.executor import model_runner
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.model.llama import SeqInput
from bie_trt.model.synthetic import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import resource, sys
from pathlib import Path
from bie_trt.builder.build import calibrate_keys
from bie_trt.model.synthetic import random_weights, tiny_llama

# 16 layers whose dequantised fp32 weights are 36 MB each: 570 MB if every layer kept its own
cfg = tiny_llama(hidden_size=1024, num_heads=8, num_kv_heads=2, num_layers=16, vocab_size=256)
weights = random_weights(cfg, group_size=128)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mean = calibrate_keys(cfg, weights, Path(sys.argv[1])).keys.mean(dim=2)
assert mean.shape == (16, 2, 128) and mean.isfinite().all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)   # MiB (ru_maxrss is KiB)
"""


@pytest.mark.slow
def test_key_calibration_does_not_keep_dequantised_layers(tmp_path):
    tokenizer = write_word_tokenizer(tmp_path / "tok")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", MEASURE, str(tokenizer)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    growth_mib = int(res.stdout.split()[-1])
    assert growth_mib < 300, f"calibration grew the process by {growth_mib} MiB"


def test_a_host_short_of_memory_streams_layers_to_the_same_logits(smollm2_engine, monkeypatch):
    config = EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_num_seqs=1, max_model_len=64)
    kept = ModelRunner(config)
    monkeypatch.setattr(model_runner, "_available_memory", lambda: 64 * 2**20)   # 64 MiB: too little to keep
    streamed = ModelRunner(config)
    linears = [lin for runner in (kept, streamed) for layer in runner.model.layers for lin in layer.linears.values()]
    half = len(linears) // 2
    assert all(lin.keep_dense for lin in linears[:half]) and not any(lin.keep_dense for lin in linears[half:])
    ids = torch.tensor([1, 504, 3458, 314, 4649, 357])

    def logits(runner: ModelRunner) -> torch.Tensor:
        return runner.forward([SeqInput(ids, 0, [0], all_logits=True)])[0]

    assert torch.equal(logits(kept), logits(streamed))
    assert not any(lin._dense is not None for layer in streamed.model.layers for lin in layer.linears.values())
