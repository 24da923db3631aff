"""What a quantised KV cache must hold after a prompt: the raw keys (read from an FP16 cache of the same engine)
after the engine's key transforms -- its mean subtracted where centering is on, divided by its stored scale
where the key scale is on, rotated -- exactly in the FP16 rows, within the format's rounding once quantised."""
from __future__ import annotations

from pathlib import Path

import torch

from bie_trt.config import EngineConfig
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.kv.pool import encode_quant_block
from bie_trt.kv.quant import dequantize_blocks, quantize_block
from bie_trt.kv.rotation import rotate
from bie_trt.model.llama import SeqInput


def rounding_bound(dtype: str, x: torch.Tensor) -> torch.Tensor:
    """How far the cache's quantiser may move each value of keys x [..., D]. INT4: half a step, the step being
    the head's range over 15 levels (a group's range is at most that). FP8 e4m3 with one scale a token
    (absmax / 448): half a unit of its 3-bit mantissa, 1/16 of the value, or half its smallest subnormal step,
    scale / 1024."""
    if dtype == "int4_asym":
        return ((x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 30).expand_as(x)
    return torch.maximum(x.abs() / 16, x.abs().amax(-1, keepdim=True) / 448 / 1024)


def assert_cache_holds_transformed_keys(engine_dir: Path, dtype: str) -> ModelRunner:
    """Prefill 40 tokens into an FP16 cache and a `dtype` one of the engine; every layer's keys in the second
    must be the first's, transformed as the engine says. Returns the `dtype` runner."""
    tokens = torch.arange(3, 43)
    table = list(range(3))

    def run(kv_cache_dtype: str) -> ModelRunner:
        runner = ModelRunner(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=1,
                                          num_kv_blocks=4, kv_cache_dtype=kv_cache_dtype, kv_window=1024))
        runner.forward([SeqInput(tokens, 0, table)])
        return runner

    raw, runner = run("fp16"), run(dtype)
    model, kv = runner.model, runner.kv_config
    quantize_block(runner.pools, None, table, table)
    for layer in range(runner.model_config.num_layers):
        k_raw = dequantize_blocks(raw.pools, layer, table)[0][:, :len(tokens)]
        # the pre-RoPE mean, turned to each key's position (kernels/key_offset.py), written out here
        angle = torch.arange(len(tokens)).double()[:, None] * model.rope.inv_freq_of(layer).double()[None, :]
        c, s = angle.cos().float(), angle.sin().float()
        m1, m2 = model.key_mean[layer].float()[:, None].chunk(2, dim=-1)
        mean = torch.cat([m1 * c - m2 * s, m2 * c + m1 * s], dim=-1) if kv.key_centering else 0
        scale = model.key_scale[layer].float()[:, None] if kv.key_scale else 1
        expected = rotate((k_raw - mean) / scale)
        k_fp = dequantize_blocks(runner.pools, layer, table)[0][:, :len(tokens)]
        k_q = dequantize_blocks(runner.pools, layer, [encode_quant_block(b) for b in table])[0][:, :len(tokens)]
        torch.testing.assert_close(k_fp, expected, atol=1e-3, rtol=1e-3)
        assert ((k_q - expected).abs() <= rounding_bound(dtype, expected) * 1.01 + 1e-3).all(), layer
    return runner
