"""A tiny random Llama (or, with its architecture, Qwen2 or Qwen3) checkpoint (real safetensors, the SmolLM2 tokenizer)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
            model_type="llama", bos_token_id=1, eos_token_id=2)
# Qwen3's structure: q/k head norms, head_dim 32 with hidden 64 over 4 heads (q_size 128 != hidden), no qkv
# bias; an eps large against the heads' mean squares (~0.2), so that where it goes changes the logits.
TINY_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, attention_bias=False,
                  rms_norm_eps=0.02, use_sliding_window=False, sliding_window=None)
# Gemma 3's structure over three layers, the last one full (sliding_window_pattern 3): a window of 24
# positions (a block and a half), query_pre_attn_scalar apart from head_dim, the two RoPE bases apart, tied
# embeddings, logits soft-capped (the 270M leaves that off).
TINY_GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=32, num_hidden_layers=3,
                   attention_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=48,
                   sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0)


def write_tiny_hf(out: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """An unquantised fp16 checkpoint directory."""
    cfg = {**TINY, **overrides}
    g = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).half()

    gemma = cfg["architectures"] == ["Gemma3ForCausalLM"]

    def norm_weight(n: int) -> torch.Tensor:
        # Gemma scales by (1 + w): w around 0, distinct per norm so a swapped or missing norm shows
        return (rnd(n) * 6).half() if gemma else torch.ones(n).half()

    t = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h), "model.norm.weight": norm_weight(h)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(cfg["vocab_size"], h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                  p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                  p + "mlp.down_proj.weight": rnd(h, i),
                  p + "input_layernorm.weight": norm_weight(h),
                  p + "post_attention_layernorm.weight": norm_weight(h)})
        if gemma:
            t.update({p + f"{x}_feedforward_layernorm.weight": norm_weight(h) for x in ("pre", "post")})
        if cfg.get("attention_bias", cfg["architectures"] == ["Qwen2ForCausalLM"]):   # Qwen2: q, k and v biased
            t.update({p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                      p + "self_attn.v_proj.bias": rnd(kv)})
        if cfg["architectures"] == ["Qwen3ForCausalLM"] or gemma:   # distinct weights: a q/k swap must show
            t.update({p + f"self_attn.{x}_norm.weight": (1 + rnd(d) * 6).half() for x in "qk"})
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / f).exists():
            shutil.copyfile(tokenizer_from / f, out / f)
    return out

