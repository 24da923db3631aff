"""RoPE scaling read from config.json equals transformers' own: YaRN's frequencies and attention factor,
Llama-3.1's frequencies, the context limit YaRN stretches, and one clear line for types not supported."""
from __future__ import annotations

import math

import pytest
import torch

from bie_trt.config import ModelConfig
from bie_trt.errors import CheckpointError
from bie_trt.kernels.rope import Rope, attention_factor, cos_sin, inverse_frequencies

QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
            rope_theta=10000.0)
LLAMA = dict(QWEN25_7B, architectures=["LlamaForCausalLM"], hidden_size=4096, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0)

YARN_CASES = {
    # Qwen2.5's documented long-context block
    "qwen2.5 x4": (QWEN25_7B, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "tiny x4": (TINY, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # DeepSeek-style: the attention factor from mscale over mscale_all_dim
    "mscale ratio": (LLAMA, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "mscale equal": (LLAMA, {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192,
                             "mscale": 0.8, "mscale_all_dim": 0.8}),
    # only one of the two: transformers falls back to 0.1 ln(factor) + 1
    "mscale alone": (LLAMA, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "mscale": 0.5}),
    "explicit attention factor": (TINY, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                         "attention_factor": 0.9}),
    "betas, untruncated": (QWEN25_7B, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    # a null factor is max_position_embeddings / original
    "factor from lengths": (dict(TINY, max_position_embeddings=256),
                            {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}),
}


def hf_rope(hf: dict, rope: dict) -> tuple[torch.Tensor, float]:
    """transformers' own inverse frequencies and attention scaling for this config."""
    from transformers import LlamaConfig, Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls = Qwen2Config if hf["architectures"] == ["Qwen2ForCausalLM"] else LlamaConfig
    cfg = cls(**{k: v for k, v in hf.items() if k != "architectures"}, rope_scaling=dict(rope))
    kind = rope.get("rope_type") or rope["type"]
    return ROPE_INIT_FUNCTIONS[kind](cfg)


def ours(hf: dict, rope: dict) -> ModelConfig:
    return ModelConfig.from_hf({**hf, "rope_scaling": dict(rope)})


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_equals_transformers(case: str) -> None:
    hf, rope = YARN_CASES[case]
    inv_hf, scale_hf = hf_rope(hf, rope)
    cfg = ours(hf, rope)
    assert cfg.rope_scaling.rope_type == "yarn"
    assert torch.equal(inverse_frequencies(cfg), inv_hf)
    assert attention_factor(cfg.rope_scaling) == pytest.approx(scale_hf, rel=1e-12)
    # the tables transformers rotates by: its cos/sin times the attention scaling
    pos = torch.tensor([0, 1, 63, 64, 255, 1000])
    cos, sin = cos_sin(pos, inverse_frequencies(cfg), torch.float32)
    emb = torch.cat([pos.float()[:, None] * inv_hf[None, :]] * 2, dim=-1)
    assert torch.equal(cos[:, 0] * Rope(cfg, torch.device("cpu")).attention_factor, emb.cos() * scale_hf)
    assert torch.equal(sin[:, 0] * Rope(cfg, torch.device("cpu")).attention_factor, emb.sin() * scale_hf)


def test_yarn_attention_factor_values() -> None:
    """The formulas themselves, so that a shared mistake with the reference cannot pass unnoticed."""
    qwen = ours(*YARN_CASES["qwen2.5 x4"]).rope_scaling
    assert attention_factor(qwen) == pytest.approx(0.1 * math.log(4) + 1)
    ds = ours(*YARN_CASES["mscale ratio"]).rope_scaling
    assert attention_factor(ds) == pytest.approx((0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1))
    assert attention_factor(ours(*YARN_CASES["mscale equal"]).rope_scaling) == 1.0
    assert attention_factor(ours(*YARN_CASES["explicit attention factor"]).rope_scaling) == 0.9


def test_yarn_keeps_fast_and_slows_slow_dimensions() -> None:
    cfg = ours(*YARN_CASES["qwen2.5 x4"])
    plain = inverse_frequencies(ModelConfig.from_hf(QWEN25_7B))
    inv = inverse_frequencies(cfg)
    assert torch.allclose(inv[:8], plain[:8], rtol=1e-6)       # many turns over 32k: unchanged
    assert torch.allclose(inv[-8:], plain[-8:] / 4, rtol=1e-6)   # under one turn: interpolated
    assert ((inv[8:-8] < plain[8:-8]) & (inv[8:-8] > plain[8:-8] / 4)).any()


def test_llama3_equals_transformers() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    inv_hf, scale_hf = hf_rope(LLAMA, rope)
    cfg = ours(LLAMA, rope)
    assert torch.allclose(inverse_frequencies(cfg), inv_hf, rtol=1e-6, atol=0)
    assert scale_hf == 1.0 and attention_factor(cfg.rope_scaling) == 1.0
    assert cfg.max_positions == 131072


def test_yarn_stretches_the_context_limit() -> None:
    assert ModelConfig.from_hf(QWEN25_7B).max_positions == 32768
    assert ours(*YARN_CASES["qwen2.5 x4"]).max_positions == 131072
    assert ours(*YARN_CASES["tiny x4"]).max_positions == 256


def test_yarn_round_trips_through_the_manifest_dict() -> None:
    cfg = ours(*YARN_CASES["mscale ratio"])
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_linear_scaling_divides_every_frequency_by_its_factor() -> None:
    """transformers' "linear" RoPE (Gemma 3's full layers): positions, hence frequencies, divided by factor."""
    plain = inverse_frequencies(ModelConfig.from_hf(QWEN25_7B))
    assert torch.allclose(inverse_frequencies(ours(QWEN25_7B, {"rope_type": "linear", "factor": 8.0})), plain / 8)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_unsupported_rope_types_are_named(kind: str) -> None:
    with pytest.raises(CheckpointError) as e:
        ours(QWEN25_7B, {"rope_type": kind, "factor": 2.0})
    msg = str(e.value)
    assert f"rope scaling type {kind!r} is not supported" in msg and "yarn" in msg and "\n" not in msg


def test_yarn_without_a_factor_or_with_a_bad_one_is_named() -> None:
    with pytest.raises(CheckpointError, match="'yarn' has a value that is not a number"):
        ours(QWEN25_7B, {"type": "yarn", "factor": "four", "original_max_position_embeddings": 32768})


def test_a_rope_scaling_block_replaces_the_type_of_rope_parameters() -> None:
    """A transformers-5 config (rope_parameters) with Qwen's YaRN block added in its older spelling."""
    hf = {**QWEN25_7B, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    del hf["rope_theta"]
    cfg = ours(hf, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_theta == 1000000.0
    assert torch.equal(inverse_frequencies(cfg), inverse_frequencies(ours(*YARN_CASES["qwen2.5 x4"])))


def test_a_yarn_factor_below_one_is_refused() -> None:
    with pytest.raises(CheckpointError, match="YaRN's factor must be >= 1.*got 0.5"):
        ours(QWEN25_7B, {"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32768})
