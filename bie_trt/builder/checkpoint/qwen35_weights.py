"""A Qwen3.5 text model's tensors (transformers' `Qwen3_5ForCausalLM` names) -> the engine's runtime weights.

The layout the decoder reads (model/llama.py, model/gated_deltanet.py):
  full-attention layers: qkv = [q | k | v | gate] (q_proj interleaves each head's query and gate; the gate
      rows come last), q, k and their norms in `partial_rotary_order`, o, gate_up, down
  DeltaNet layers: in_proj = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a], out_proj, gate_up, down,
      conv [C, W], A_log, dt_bias, delta_norm (the gated norm's plain weight)

Every linear arrives already in the runtime's W4 tensors (`linear(name)`: from an AWQ checkpoint, or rounded
from a dense weight) and is reordered by output rows only, which the W4 layout keeps whole: the build and the
tests share this one conversion.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...config import ModelConfig
from ...kernels.awq import quantize_rtn
from ...kernels.rope import partial_rotary_order
from ...kernels.w4_layout import awq_to_w4

W4 = dict[str, torch.Tensor]   # one linear's runtime tensors (qweight, scales, zeros), a row per output feature
# The small linears that stay unquantised in a `bie-trt quantize` checkpoint: one row per value head, too few
# for AWQ's packing of 8 output features a word; the build rounds them into the fused in_proj.
DENSE_LINEARS = ("in_proj_b", "in_proj_a")
# Kept in fp32 in the engine: the decay's parameters (exp(A_log) and softplus(a + dt_bias) set how fast the
# state forgets, over the whole context).
FP32_TENSORS = ("A_log", "dt_bias")


def dense_w4(weight: torch.Tensor, group_size: int) -> W4:
    """nn.Linear weight [out, in] -> the runtime W4 tensors, rounded to nearest. Each output row is rounded on
    its own, so rows of zeros pad it to the 8 a word of AWQ's packing holds and are cut off again."""
    rows = weight.shape[0]
    padded = torch.cat([weight.float(), weight.new_zeros(-rows % 8, weight.shape[1]).float()])
    return {k: v[:rows] for k, v in awq_to_w4(*quantize_rtn(padded.t(), group_size)).items()}


def _rows(w: W4, index: torch.Tensor) -> W4:
    return {k: v[index] for k, v in w.items()}


def stack(parts: list[W4]) -> W4:
    """Linears fused by output rows (qkv, gate_up): their W4 tensors one after another."""
    return {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}


def layer_weights(cfg: ModelConfig, i: int, tensor: Callable[[str], torch.Tensor],
                  linear: Callable[[str], W4]) -> dict[str, torch.Tensor]:
    """Layer `i`'s runtime weights. `tensor(name)`: a checkpoint tensor by its transformers name;
    `linear(name)`: the W4 tensors of the linear `name` (without `.weight`)."""
    D, order = cfg.head_dim, partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
    src, dst = f"model.layers.{i}.", f"layers.{i}."

    fused: dict[str, W4] = {"gate_up": stack([linear(src + "mlp.gate_proj"), linear(src + "mlp.up_proj")]),
                            "down": linear(src + "mlp.down_proj")}
    out = {dst + "attn_norm": tensor(src + "input_layernorm.weight"),
           dst + "mlp_norm": tensor(src + "post_attention_layernorm.weight")}
    if i in cfg.linear_layers:
        a = src + "linear_attn."
        fused["in_proj"] = stack([linear(a + f"in_proj_{x}") for x in ("qkv", "z", "b", "a")])
        fused["out_proj"] = linear(a + "out_proj")
        out[dst + "conv"] = tensor(a + "conv1d.weight").squeeze(1)
        out[dst + "A_log"], out[dst + "dt_bias"] = tensor(a + "A_log"), tensor(a + "dt_bias")
        out[dst + "delta_norm"] = tensor(a + "norm.weight")
    else:
        a = src + "self_attn."
        q_gate = linear(a + "q_proj")   # per head: D query rows, then D gate rows
        query = _rows(q_gate, torch.cat([2 * h * D + order for h in range(cfg.num_heads)]))
        gate = _rows(q_gate, torch.cat([torch.arange((2 * h + 1) * D, (2 * h + 2) * D) for h in range(cfg.num_heads)]))
        key = _rows(linear(a + "k_proj"), torch.cat([h * D + order for h in range(cfg.num_kv_heads)]))
        fused["qkv"] = stack([query, key, linear(a + "v_proj"), gate])
        fused["o"] = linear(a + "o_proj")
        out[dst + "q_norm"], out[dst + "k_norm"] = tensor(a + "q_norm.weight")[order], tensor(a + "k_norm.weight")[order]
    for name, w in fused.items():
        out.update({f"{dst}{name}.{k}": v for k, v in w.items()})
    return out


LayerWeights = Callable[[ModelConfig, int, Callable[[str], torch.Tensor], Callable[[str], W4]], dict[str, torch.Tensor]]


def dense_runtime_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], group_size: int,
                          layer: LayerWeights) -> dict[str, torch.Tensor]:
    """`hf`: a text model's dense state dict (model.layers.N...., model.embed_tokens, model.norm, lm_head),
    every linear rounded to W4 (round to nearest, `group_size`), the rest as given; each layer's through its
    family's `layer` (this module's `layer_weights`, or gemma4_weights')."""
    out = {"embed_tokens": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        out.update(layer(cfg, i, hf.__getitem__, lambda name: dense_w4(hf[name + ".weight"], group_size)))
    return out


def runtime_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A Qwen3.5's dense state dict -> its runtime weights (`dense_runtime_weights`)."""
    return dense_runtime_weights(cfg, hf, group_size, layer_weights)
