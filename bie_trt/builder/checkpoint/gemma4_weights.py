"""A Gemma 4 text model's tensors (transformers' `Gemma4ForCausalLM` names, unquantised) -> the engine's runtime
weights, every attention and MLP linear rounded to W4 (round to nearest, `group_size`); the per-layer embedding
weights stay dense.

The layout the decoder reads (model/llama.py, model/per_layer.py):
  every layer: attn_norm, post_attn_norm, mlp_norm, post_mlp_norm, q_norm, o, gate_up, down, layer_scalar
  owning layers: qkv = [q | k | v], or [q | k] where keys are values; k_norm
  KV-shared layers: qkv = q alone (no k/v projection or norm)
  per-layer embeddings: per_layer.embed [V, L x P], per_layer.projection [L x P, H], per_layer.norm [P]; and in
      each layer per_layer_gate [P, H], per_layer_projection [H, P], post_per_layer_norm [H]
"""
from __future__ import annotations

import torch

from ...config import ModelConfig
from .qwen35_weights import dense_w4

_DENSE_PER_LAYER = {"per_layer_input_gate.weight": "per_layer_gate",
                    "per_layer_projection.weight": "per_layer_projection",
                    "post_per_layer_input_norm.weight": "post_per_layer_norm"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
          "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}


def runtime_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """`hf`: the text model's state dict (model.layers.N...., model.embed_tokens, model.norm, lm_head)."""
    out = {"embed_tokens": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    if cfg.per_layer_input_size:
        out["per_layer.embed"] = hf["model.embed_tokens_per_layer.weight"]
        out["per_layer.projection"] = hf["model.per_layer_model_projection.weight"]
        out["per_layer.norm"] = hf["model.per_layer_projection_norm.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        out.update({dst + ours: hf[src + theirs + ".weight"] for theirs, ours in _NORMS.items()})
        out[dst + "layer_scalar"] = hf[src + "layer_scalar"]
        out[dst + "q_norm"] = hf[a + "q_norm.weight"]
        qkv = [hf[a + "q_proj.weight"]]
        if cfg.kv_source(i) == i:
            qkv.append(hf[a + "k_proj.weight"])
            if not cfg.k_eq_v_at(i):
                qkv.append(hf[a + "v_proj.weight"])
            out[dst + "k_norm"] = hf[a + "k_norm.weight"]
        if cfg.per_layer_input_size:
            out.update({dst + ours: hf[src + theirs] for theirs, ours in _DENSE_PER_LAYER.items()})
        fused = {"qkv": torch.cat(qkv), "o": hf[a + "o_proj.weight"],
                 "gate_up": torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]),
                 "down": hf[src + "mlp.down_proj.weight"]}
        for name, weight in fused.items():
            out.update({f"{dst}{name}.{k}": v for k, v in dense_w4(weight, group_size).items()})
    return out
