"""A Qwen3.5 text model's tensors (transformers' `Qwen3_5ForCausalLM` names, unquantised) -> the engine's runtime
weights, every linear rounded to W4 (round to nearest, `group_size`).

The layout the decoder reads (model/llama.py, model/gated_deltanet.py):
  full-attention layers: qkv = [q | k | v | gate] (q_proj interleaves each head's query and gate; the gate
      rows come last), q, k and their norms in `partial_rotary_order`, o, gate_up, down
  DeltaNet layers: in_proj = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a], out_proj, gate_up, down,
      conv [C, W], A_log, dt_bias, delta_norm (the gated norm's plain weight)
"""
from __future__ import annotations

import torch

from ...config import ModelConfig
from ...kernels.awq import quantize_rtn
from ...kernels.rope import partial_rotary_order
from ...kernels.w4_layout import awq_to_w4


def _w4(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """nn.Linear weight [out, in] -> the runtime W4 tensors."""
    return awq_to_w4(*quantize_rtn(weight.t().float(), group_size))


def runtime_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """`hf`: the text model's state dict (model.layers.N...., model.embed_tokens, model.norm, lm_head)."""
    D, order = cfg.head_dim, partial_rotary_order(cfg.head_dim, cfg.rotary_dim)

    def heads(w: torch.Tensor) -> torch.Tensor:   # rows of q or k heads into the engine's channel order
        return w.reshape(-1, D, *w.shape[1:])[:, order].reshape(w.shape)

    out = {"embed_tokens": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    linear = set(cfg.linear_layers)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        fused: dict[str, torch.Tensor] = {
            "gate_up": torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]),
            "down": hf[src + "mlp.down_proj.weight"]}
        out[dst + "attn_norm"] = hf[src + "input_layernorm.weight"]
        out[dst + "mlp_norm"] = hf[src + "post_attention_layernorm.weight"]
        if i in linear:
            a = src + "linear_attn."
            fused["in_proj"] = torch.cat([hf[a + f"in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")])
            fused["out_proj"] = hf[a + "out_proj.weight"]
            out[dst + "conv"] = hf[a + "conv1d.weight"].squeeze(1)
            out[dst + "A_log"], out[dst + "dt_bias"] = hf[a + "A_log"], hf[a + "dt_bias"]
            out[dst + "delta_norm"] = hf[a + "norm.weight"]
        else:
            a = src + "self_attn."
            q_gate = hf[a + "q_proj.weight"].reshape(cfg.num_heads, 2, D, -1)
            query, gate = q_gate[:, 0].reshape(cfg.q_size, -1), q_gate[:, 1].reshape(cfg.q_size, -1)
            fused["qkv"] = torch.cat([heads(query), heads(hf[a + "k_proj.weight"]), hf[a + "v_proj.weight"], gate])
            fused["o"] = hf[a + "o_proj.weight"]
            out[dst + "q_norm"], out[dst + "k_norm"] = hf[a + "q_norm.weight"][order], hf[a + "k_norm.weight"][order]
        for name, weight in fused.items():
            out.update({f"{dst}{name}.{k}": v for k, v in _w4(weight, group_size).items()})
    return out
