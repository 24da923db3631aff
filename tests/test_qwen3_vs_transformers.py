"""A tiny random Qwen3 checkpoint (per-head q/k norms, head_dim 32 over hidden 64 and 4 heads), AWQ-packed
and built through the real build, read past a short "original" context: its greedy tokens equal
transformers' Qwen3ForCausalLM on the dequantised weights, its logits too within fp32 rounding (FP16 KV
format; the CPU path keeps activations in fp32)."""
from __future__ import annotations

import pytest
import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.builder.key_centering import CALIBRATION_TEXT
from bie_trt.config import EngineConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.kernels import triton_ops
from bie_trt.sampling_params import SamplingParams
from hf_reference import hf_model, run_engine_logits
from tiny_model import TINY_QWEN3, write_tiny_hf

ORIGINAL_CONTEXT = 64                     # the context a rope scaling would stretch
PROMPT_TOKENS = 2 * ORIGINAL_CONTEXT + 16  # past twice of it, and not a whole number of blocks
GREEDY_TOKENS = 16
MAX_LOGIT_DIFF = 1e-4
# Each rope_scaling the engine reads for Qwen3 (None: plain RoPE), over max_position_embeddings of four
# originals. YaRN, in Qwen3's own spelling, is the hard case; plain RoPE runs in the slow suite.
ROPE_SCALINGS = {"default": None,
                 "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}}


@pytest.fixture(scope="module", params=["yarn", pytest.param("default", marks=pytest.mark.slow)])
def qwen3(request, build, tmp_path_factory, smollm2_checkpoint):
    """(engine, prompt ids, transformers' greedy continuation, transformers' logits over prompt + continuation)."""
    root = tmp_path_factory.mktemp(f"tiny-qwen3-{request.param}")
    scaling = ROPE_SCALINGS[request.param]
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, **TINY_QWEN3, max_position_embeddings=4 * ORIGINAL_CONTEXT,
                       **({"rope_scaling": scaling} if scaling else {}))
    awq = quantize_checkpoint(hf, root / "awq", group_size=32)
    engine_dir = build(checkpoint=str(awq), max_model_len=4 * ORIGINAL_CONTEXT, kv_cache_dtype="fp16")
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    ids = engine.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    model = hf_model(Checkpoint(awq))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                             do_sample=False)[0].tolist()
        logits = model(torch.tensor([out])).logits[0]
    return engine, ids, out[len(ids):], logits


def test_the_engine_reads_the_checkpoint_as_qwen3(qwen3):
    cfg = qwen3[0].core.runner.model.cfg
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.qkv_bias
    assert (cfg.head_dim, cfg.q_size) == (32, 128) and cfg.q_size != cfg.hidden_size


def test_greedy_tokens_equal_transformers(qwen3):
    engine, ids, continuation, _ = qwen3
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == continuation


@pytest.mark.parametrize("scatter, chunk, kernels", [(False, 512, "reference"), (True, 48, "reference"),
                                                    pytest.param(True, 48, "triton", marks=pytest.mark.slow)],
                         ids=["one-chunk", "chunks-scattered", "chunks-scattered-triton"])
def test_logits_equal_transformers(qwen3, scatter, chunk, kernels, monkeypatch):
    """Every prompt position and each decode step of the continuation; in chunks of 48 over scattered
    blocks the prefill also reads K/V written by earlier chunks. "triton": the device kernels (the q/k
    norms inside the qkv epilogue), interpreted on the CPU."""
    if kernels == "triton" and not triton_ops.available():
        pytest.skip("triton not importable")
    monkeypatch.setenv("BIE_TRT_KERNELS", kernels)
    engine, ids, continuation, hf = qwen3
    ours = torch.cat(run_engine_logits(engine, ids, continuation, scatter, chunk))
    # ours[i] predicts position i + 1; the last continuation token is never fed in
    hf = hf[: len(ids) + len(continuation)]
    assert ours.shape == hf.shape
    diff = (ours - hf).abs().max().item()
    assert diff <= MAX_LOGIT_DIFF, f"max |Δlogit| = {diff}"
