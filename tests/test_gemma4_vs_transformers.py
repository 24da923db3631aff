"""A tiny random Gemma 4 (per-layer embeddings, KV-shared layers, 64-wide full heads with their own KV head
count and keys reused as values, proportional RoPE, a 24-position window) through the engine's one decoder
forward: its logits over a prompt of several windows, prefilled in chunks over scattered blocks, and over a
greedy continuation (decoded, then read as a speculative verify would) equal transformers' Gemma4ForCausalLM on the same weights within fp32 rounding, and so do
its greedy tokens."""
from __future__ import annotations

import random

import pytest
import torch

from bie_trt.config import ModelConfig
from bie_trt.kernels import triton_ops
from bie_trt.kernels.step_inputs import SeqInput
from gemma4_tiny import GREEDY_TOKENS, PROMPT_TOKENS, TINY_GEMMA4, TINY_GEMMA4_UNIFIED, WINDOW, engine_model, hf_tiny_gemma4
from hf_reference import greedy_reference

CHUNK = 40               # chunks that a window spans
MAX_LOGIT_DIFF = 1e-4    # of the largest |logit|


def run(model, pools, ids: list[int], continuation: list[int]) -> torch.Tensor:
    """Prefill `ids` in chunks (every position's logits), decode the first half of `continuation` one token a
    step, then the rest as one verify-sized input (as a speculative step reads the cache): [rows, V]. Each cache
    group through its own scattered table."""
    table, sliding = list(range(16)), list(range(16))
    random.Random(0).shuffle(table)
    random.Random(1).shuffle(sliding)

    def step(tokens: list[int], start: int, all_logits: bool) -> torch.Tensor:
        seq = SeqInput(torch.tensor(tokens), start, table, all_logits=all_logits, sliding_table=sliding)
        return model.forward([seq], pools)[0]

    half = len(continuation) // 2
    rows = [step(ids[s:s + CHUNK], s, True) for s in range(0, len(ids), CHUNK)]
    rows += [step([t], len(ids) + i, False)[None] for i, t in enumerate(continuation[:half])]
    rows.append(step(continuation[half:], len(ids) + half, True))
    return torch.cat(rows)


def test_config_reads_the_gemma4_switches():
    cfg = ModelConfig.from_hf(TINY_GEMMA4)
    assert cfg.family == "gemma4" and cfg.sliding_layers == (0, 1, 3, 4) and cfg.window_of(0) == WINDOW
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert (cfg.head_dim_of(0), cfg.head_dim_of(2), cfg.kv_heads_of(0), cfg.kv_heads_of(5)) == (32, 64, 2, 1)
    assert cfg.k_eq_v_at(2) and not cfg.k_eq_v_at(1) and cfg.value_norm and cfg.norm_offset == 0.0
    assert (cfg.intermediate_of(3), cfg.intermediate_of(4)) == (64, 128)
    assert (cfg.cache_layers(), cfg.cache_layers(sliding=True)) == (1, 3)
    assert cfg.global_rope_proportion == 0.25 and cfg.query_pre_attn_scalar == 1.0
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (16, 256)


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_logits_and_greedy_tokens_equal_transformers(gemma4_reference, kernels, monkeypatch):
    if kernels == "triton" and not triton_ops.available():
        pytest.skip("triton not importable")
    monkeypatch.setenv("BIE_TRT_KERNELS", kernels)
    hf_model, ids, continuation, hf_logits = gemma4_reference
    model, pools = engine_model(hf_model)
    # the shared layers own no cache: one full layer and three sliding ones hold K/V, of their own widths
    assert tuple(pools.k.shape[::2]) == (1, 1, 64) and tuple(pools.sliding.k.shape[::2]) == (3, 2, 32)
    ours = run(model, pools, ids, continuation)
    hf_logits = hf_logits[: len(ids) + len(continuation)]
    assert ours.shape == hf_logits.shape
    diff = (ours - hf_logits).abs().max().item() / hf_logits.abs().max().item()
    assert diff <= MAX_LOGIT_DIFF, f"max |Δlogit| = {diff} of the largest"
    assert ours[len(ids) - 1:-1].argmax(-1).tolist() == continuation


def test_the_12b_text_model_without_per_layer_embeddings_equals_transformers():
    """transformers' Gemma4UnifiedForCausalLM (the 12B's text model: no per-layer table, otherwise the same
    switches) through the same decoder: its logits and greedy tokens."""
    hf_model = hf_tiny_gemma4(config=TINY_GEMMA4_UNIFIED)
    ids, continuation, hf_logits = greedy_reference(hf_model, PROMPT_TOKENS, GREEDY_TOKENS)
    model, pools = engine_model(hf_model, config=TINY_GEMMA4_UNIFIED)
    assert model.per_layer is None
    ours = run(model, pools, ids, continuation)
    hf_logits = hf_logits[: len(ids) + len(continuation)]
    assert (ours - hf_logits).abs().max() <= MAX_LOGIT_DIFF * hf_logits.abs().max()
    assert ours[len(ids) - 1:-1].argmax(-1).tolist() == continuation
