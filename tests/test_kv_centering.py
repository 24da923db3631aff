"""Key centering: the build's mean key is the real one, subtracting it leaves attention exact, and it
shrinks INT4 rounding error on text the calibration never saw."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.key_centering import SKIP_POSITIONS, calibration_ids
from bie_trt.config import EngineConfig
from bie_trt.engine_format import WEIGHTS
from bie_trt.errors import EngineError
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.kv.quant import dequantize_int4_asym, quantize_int4_asym
from bie_trt.kv.rotation import rotate
from bie_trt.model.llama import SeqInput
from hf_reference import hf_model


@pytest.fixture(scope="module")
def hf(smollm2_checkpoint):
    return hf_model(Checkpoint(smollm2_checkpoint))


def turn(x: torch.Tensor, positions: torch.Tensor, model, sign: int = 1) -> torch.Tensor:
    """x [..., T, D] turned by RoPE (sign -1: turned back) at `positions` [T], written out from the model's
    config (rotate-half pairs i, i + D/2 at angle position · theta^(-2i/D)), float64."""
    d = x.shape[-1]
    inv = model.config.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv[None, :]
    c, s = angle.cos(), sign * angle.sin()
    x1, x2 = x.double()[..., :d // 2], x.double()[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def hf_keys(model, ids: list[int]) -> torch.Tensor:
    """Post-RoPE keys from transformers' own cache: [L, Hkv, T, D]."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    return torch.stack([layer.keys[0] for layer in cache.layers])


@pytest.mark.slow
def test_built_key_mean_is_the_mean_transformers_keys(smollm2_engine, hf):
    from transformers import AutoTokenizer

    stored = load_file(str(smollm2_engine / WEIGHTS))["kv.key_mean"]
    ids = calibration_ids(AutoTokenizer.from_pretrained(smollm2_engine))
    # the mean before RoPE: transformers' post-RoPE keys turned back by their positions
    positions = torch.arange(SKIP_POSITIONS, len(ids))
    expected = turn(hf_keys(hf, ids)[:, :, SKIP_POSITIONS:], positions, hf, -1).mean(dim=2).float()
    assert stored.dtype == torch.float16 and stored.shape == expected.shape
    assert expected.abs().max() > 1.0   # a real offset, not zeros
    torch.testing.assert_close(stored.float(), expected, atol=2e-2, rtol=1e-2)


def test_centering_reduces_int4_key_error_on_unseen_text(smollm2_engine, hf, lee_text):
    from transformers import AutoTokenizer

    mean = load_file(str(smollm2_engine / WEIGHTS))["kv.key_mean"].float()
    ids = AutoTokenizer.from_pretrained(smollm2_engine)(lee_text.read_text())["input_ids"][:256]
    keys = hf_keys(hf, ids)[:, :, SKIP_POSITIONS:]
    offsets = turn(mean[:, :, None], torch.arange(SKIP_POSITIONS, len(ids)), hf).float()   # the mean turned to each key

    def rms_int4_error(x: torch.Tensor) -> float:
        x = rotate(x)
        packed, scale, zero = quantize_int4_asym(x, 64)
        return (dequantize_int4_asym(packed, scale, zero, 64) - x).pow(2).mean().sqrt().item()

    # Errors are measured in the same (rotated) key space: rotation and centering are both exact for q·k.
    plain, centred = rms_int4_error(keys), rms_int4_error(keys - offsets)
    assert centred < 0.8 * plain, (plain, centred)


@pytest.mark.parametrize("dtype", ["int4_asym", "fp8"])
def test_centering_leaves_attention_exact(smollm2_engine, lee_text, dtype):
    """With the window covering the whole prompt nothing is quantised, so centering is the only
    difference: softmax's shift invariance must make the logits equal."""
    from transformers import AutoTokenizer

    tokens = torch.tensor(AutoTokenizer.from_pretrained(smollm2_engine)(lee_text.read_text())["input_ids"][:40])

    def logits(centering: bool) -> torch.Tensor:
        runner = ModelRunner(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_num_seqs=1,
                                          kv_cache_dtype=dtype, kv_window=1024, kv_key_centering=centering))
        return runner.forward([SeqInput(tokens, 0, list(range(3)), all_logits=True)])[0]

    on, off = logits(True), logits(False)
    assert on.shape == (40, 49152)
    torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)


def test_centering_without_a_stored_mean_fails_at_load(smollm2_engine, tmp_path):
    """An engine whose weights lack kv.key_mean (edited, or from a foreign tool) is refused when loaded
    with centering on, naming the missing tensor and the fix, not at the first forward step."""
    engine = Path(shutil.copytree(smollm2_engine, tmp_path / "engine"))
    weights = load_file(str(engine / WEIGHTS))
    del weights["kv.key_mean"]
    save_file(weights, str(engine / WEIGHTS))
    # the edit breaks the weights' digest on purpose: skip that check to reach the one under test
    ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", kv_cache_dtype="int4_asym", skip_verify=True))
    with pytest.raises(EngineError, match="kv.key_mean.*rebuild"):
        ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", kv_cache_dtype="int4_asym",
                                 kv_key_centering=True, skip_verify=True))
