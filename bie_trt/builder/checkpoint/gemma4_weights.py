"""A Gemma 4 text model's tensors (transformers' `Gemma4ForCausalLM` names) -> the engine's runtime weights:
every attention and MLP linear in W4 (from an AWQ checkpoint, or rounded from a dense weight), the per-layer
embedding weights dense. The build and the tests share this one conversion.

The layout the decoder reads (model/llama.py, model/per_layer.py):
  every layer: attn_norm, post_attn_norm, mlp_norm, post_mlp_norm, q_norm, o, gate_up, down, layer_scalar
  owning layers: qkv = [q | k | v], or [q | k] where keys are values; k_norm
  KV-shared layers: qkv = q alone (no k/v projection or norm)
  per-layer embeddings: per_layer.embed [V, L x P], per_layer.projection [L x P, H], per_layer.norm [P]; and in
      each layer per_layer_gate [P, H], per_layer_projection [H, P], post_per_layer_norm [H]
"""
from __future__ import annotations

from typing import Callable

import torch

from ...config import ModelConfig
from .qwen35_weights import W4, dense_runtime_weights, stack

_DENSE_PER_LAYER = {"per_layer_input_gate.weight": "per_layer_gate",
                    "per_layer_projection.weight": "per_layer_projection",
                    "post_per_layer_input_norm.weight": "post_per_layer_norm"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
          "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
# The model's own per-layer embedding tensors (beside embed_tokens, norm and lm_head, which every model has).
PER_LAYER_TENSORS = {"model.embed_tokens_per_layer.weight": "per_layer.embed",
                     "model.per_layer_model_projection.weight": "per_layer.projection",
                     "model.per_layer_projection_norm.weight": "per_layer.norm"}


def model_tensors(cfg: ModelConfig, tensor: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-layer embedding's table, projection and norm (none for a model without per-layer embeddings)."""
    return {ours: tensor(theirs) for theirs, ours in PER_LAYER_TENSORS.items()} if cfg.per_layer_input_size else {}


def layer_weights(cfg: ModelConfig, i: int, tensor: Callable[[str], torch.Tensor],
                  linear: Callable[[str], W4]) -> dict[str, torch.Tensor]:
    """Layer `i`'s runtime weights. `tensor(name)`: a checkpoint tensor by its transformers name;
    `linear(name)`: the W4 tensors of the linear `name` (without `.weight`)."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    a = src + "self_attn."
    out = {dst + ours: tensor(src + theirs + ".weight") for theirs, ours in _NORMS.items()}
    out[dst + "layer_scalar"] = tensor(src + "layer_scalar")
    out[dst + "q_norm"] = tensor(a + "q_norm.weight")
    qkv = [linear(a + "q_proj")]
    if cfg.kv_source(i) == i:
        qkv += [linear(a + "k_proj")] + ([] if cfg.k_eq_v_at(i) else [linear(a + "v_proj")])
        out[dst + "k_norm"] = tensor(a + "k_norm.weight")
    if cfg.per_layer_input_size:
        out.update({dst + ours: tensor(src + theirs) for theirs, ours in _DENSE_PER_LAYER.items()})
    fused = {"qkv": stack(qkv), "o": linear(a + "o_proj"),
             "gate_up": stack([linear(src + "mlp.gate_proj"), linear(src + "mlp.up_proj")]),
             "down": linear(src + "mlp.down_proj")}
    for name, w in fused.items():
        out.update({f"{dst}{name}.{k}": v for k, v in w.items()})
    return out


def runtime_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A Gemma 4's dense state dict -> its runtime weights (`dense_runtime_weights`), the per-layer embedding's
    own tensors included."""
    return dense_runtime_weights(cfg, hf, group_size, layer_weights) | model_tensors(cfg, hf.__getitem__)
