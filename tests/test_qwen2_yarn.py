"""A tiny random Qwen2 (q, k and v biased) with YaRN over a 64-position original context, AWQ-packed and
built, read past that context: greedy tokens and logits equal transformers' Qwen2ForCausalLM on the
dequantised weights with FP16 KV, and INT4 KV within the project's quality bounds."""
from __future__ import annotations

import pytest
import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt.evaluate import evaluate
from bie_trt.executor.engine import BieEngine
from bie_trt.kernels import triton_ops
from bie_trt.sampling_params import SamplingParams
from hf_reference import hf_model
from test_model_vs_transformers import run_engine_logits
from tiny_model import write_tiny_hf

ORIGINAL = 64
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}   # Qwen2.5's spelling
PROMPT = 2 * ORIGINAL + 32
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def qwen2_yarn(build, tmp_path_factory, smollm2_checkpoint):
    """(checkpoint, engine dir) of the tiny Qwen2-YaRN model; head_dim 32, so INT4 KV groups fit."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("qwen2-yarn")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, seed=3, architectures=["Qwen2ForCausalLM"],
                       model_type="qwen2", num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=ORIGINAL, rope_scaling=YARN)
    ckpt = quantize_checkpoint(hf, root / "awq", group_size=32)
    return ckpt, build(checkpoint=str(ckpt), max_model_len=4 * ORIGINAL)


@pytest.fixture(scope="module")
def reference(qwen2_yarn):
    """A prompt of random ids 2.5x the original context, transformers' greedy continuation and its logits."""
    ckpt, _ = qwen2_yarn
    ids = torch.randint(0, 49152, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    model = hf_model(Checkpoint(ckpt))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)[0].tolist()
        logits = model(torch.tensor([out])).logits[0]
    return ids, out[PROMPT:], logits


def test_engine_config_reads_yarn(qwen2_yarn):
    ckpt, _ = qwen2_yarn
    model = Checkpoint(ckpt).model
    assert model.qkv_bias and model.rope_scaling.rope_type == "yarn" and model.max_positions == 4 * ORIGINAL


def test_greedy_and_logits_equal_transformers_past_the_original_context(qwen2_yarn, reference):
    _, engine_dir = qwen2_yarn
    ids, continuation, hf_logits = reference
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == continuation
    # prefill in chunks crossing the original context, then decode the continuation
    ours = torch.cat(run_engine_logits(engine, ids, continuation, scatter=False, chunk=48))
    hf = hf_logits[:PROMPT + NEW_TOKENS]
    assert ours.shape == hf.shape
    diff = (ours - hf).abs().max().item()
    assert diff <= 1e-3 * hf.abs().max().item(), f"max |Δlogit| = {diff}"


def test_int4_kv_within_quality_bounds(qwen2_yarn, reference):
    """INT4 keys and values beyond a 16-token window: perplexity within 10% of FP16 KV over 2.75x the
    original context (the SmolLM2 bound), and most greedy tokens kept."""
    _, engine_dir = qwen2_yarn
    ids, continuation, _ = reference
    text = ids + continuation
    res = {r.label: r for r in evaluate(engine_dir, text, len(text),
                                        {"int4": KVCacheConfig(dtype="int4_asym", group_size=32, window=16)}, progress=False)}
    assert res["int4"].kld > 1e-5 and abs(res["int4"].ppl / res["fp16"].ppl - 1) < 0.1
    int4 = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", kv_cache_dtype="int4_asym",
                                    kv_group_size=32, kv_window=16))
    out = int4.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert sum(a == b for a, b in zip(out.token_ids, continuation)) >= NEW_TOKENS - 2


@pytest.mark.slow
@pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")
def test_triton_path_equals_transformers(qwen2_yarn, reference, monkeypatch):
    """The same greedy tokens through the Triton kernels (interpreted here, ~30 s): the attention factor
    reaches the fused qkv epilogue's path too."""
    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    _, engine_dir = qwen2_yarn
    ids, continuation, _ = reference
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == continuation
