"""The build's one CPU forward pass (the key calibration) keeps memory near one layer's dequantised
weights: keeping every layer's, as the CPU runtime does for speed, would need 28 GB for an 8B."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tiny_model import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import resource, sys
from pathlib import Path
from bie_trt.build import calibrate_key_mean
from bie_trt.model.synthetic import random_weights, tiny_llama

# 16 layers whose dequantised fp32 weights are 36 MB each: 570 MB if every layer kept its own
cfg = tiny_llama(hidden_size=1024, num_heads=8, num_kv_heads=2, num_layers=16, vocab_size=256)
weights = random_weights(cfg, group_size=128)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mean = calibrate_key_mean(cfg, weights, Path(sys.argv[1]))
assert mean.shape == (16, 2, 128) and mean.isfinite().all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)   # MiB (ru_maxrss is KiB)
"""


def test_key_calibration_does_not_keep_dequantised_layers(tmp_path):
    tokenizer = write_word_tokenizer(tmp_path / "tok")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", MEASURE, str(tokenizer)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    growth_mib = int(res.stdout.split()[-1])
    assert growth_mib < 300, f"calibration grew the process by {growth_mib} MiB"
