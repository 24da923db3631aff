"""Qwen3.5's Gated DeltaNet token mixer: the linear-attention sub-block of the decoder's "linear_attention"
layers, in place of attention (the MLP around it is the decoder's own).

    x            = rms_norm(h) @ in_proj          one fused W4 linear: [q k v | z | b | a]
    q, k, v      = silu(causal_conv(q k v))       depthwise, kernel W (4), over the sequence's last W-1 inputs too
    g            = -exp(A_log) * softplus(a + dt_bias)      the per-head log decay (<= 0)
    beta         = sigmoid(b)                                how much of each token is written
    o            = delta_rule(l2norm(q), l2norm(k), v, g, beta)   kernels/delta_rule.py
    h           += out_proj(rms_norm_per_head(o) * w * silu(z))

The conv inputs and the delta state live in the sequence's recurrent slot (kv/recurrent.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import ops
from ..kernels.delta_rule import causal_conv, causal_conv_step, delta_rule_inputs
from ..kernels.step_inputs import StepMetadata
from ..kernels.w4_layout import W4Weight
from ..kv.recurrent import RecurrentStates, conv_channels

LINEARS = ("in_proj", "out_proj")


def deltanet_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out features, in features) of a DeltaNet layer's fused linears, as stored in the engine."""
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return {"in_proj": (conv_channels(cfg) + value + 2 * cfg.linear_num_value_heads, cfg.hidden_size),
            "out_proj": (cfg.hidden_size, value)}


@dataclass
class DeltaNetWeights:
    """A DeltaNet layer's own small tensors (its linears live with the layer's others)."""

    conv: torch.Tensor       # [C, W] depthwise conv weight
    A_log: torch.Tensor      # [H_v] fp32
    dt_bias: torch.Tensor    # [H_v] fp32
    norm: torch.Tensor       # [V_dim] the gated RMSNorm's weight: plain w, not (1 + w)

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], prefix: str, device: torch.device,
             dtype: torch.dtype) -> "DeltaNetWeights":
        return cls(weights[prefix + "conv"].to(device=device, dtype=dtype),
                   weights[prefix + "A_log"].to(device=device, dtype=torch.float32),
                   weights[prefix + "dt_bias"].to(device=device, dtype=torch.float32),
                   weights[prefix + "delta_norm"].to(device=device, dtype=dtype))


def deltanet_block(cfg: ModelConfig, li: int, w: DeltaNetWeights, linears: dict[str, W4Weight],
                   attn_norm: torch.Tensor, h: torch.Tensor, meta: StepMetadata,
                   states: RecurrentStates) -> torch.Tensor:
    """h + the DeltaNet sub-block of layer-in-group `li` over the step's rows; each sequence's slot read and
    advanced past its rows."""
    if meta.recurrent is None:
        raise ValueError("a model with linear-attention layers needs every input's state_slot")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = conv_channels(cfg)
    x = ops.norm_linear(h, attn_norm, cfg.rms_norm_eps, linears["in_proj"])
    mixed, z, b, a = x.split([channels, hv * dv, hv, hv], dim=-1)
    g = -w.A_log.exp() * F.softplus(a.float() + w.dt_bias)
    beta = torch.sigmoid(b.float())
    # the conv: a decode batch in one step, each prefill chunk over its own carried inputs
    chunks = [(row, n, slot) for row, n, slot in meta.recurrent if n > 1]
    conv = torch.empty_like(mixed)
    if meta.recurrent_decode is not None:
        rows, slots = meta.recurrent_decode
        conv[rows] = causal_conv_step(mixed[rows], w.conv, states.conv[li], slots)
    for row, n, slot in chunks:
        conv[row:row + n], states.conv[li, slot] = causal_conv(mixed[row:row + n], w.conv, states.conv[li, slot])
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = delta_rule_inputs(q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), hv)
    v = v.reshape(-1, hv, dv).float()
    # the delta rule: the decode batch in one call, each prefill chunk in one
    out = torch.empty(h.shape[0], hv, dv, dtype=torch.float32, device=h.device)
    if meta.recurrent_decode is not None:
        out[rows] = ops.gated_delta_rule(q[rows, None], k[rows, None], v[rows, None], g[rows, None],
                                         beta[rows, None], states.delta[li], slots)[:, 0]
    for row, n, slot in chunks:
        part = slice(row, row + n)
        out[part] = ops.gated_delta_rule(q[None, part], k[None, part], v[None, part], g[None, part], beta[None, part],
                                         states.delta[li], torch.tensor([slot], device=h.device))[0]
    # the gated per-head RMSNorm (as transformers rounds it): the outputs in the activation dtype, normalised in
    # fp32, scaled by w in the activation dtype, gated by silu(z) in fp32
    o = out.to(h.dtype).float()
    normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(h.dtype) * w.norm
    gated = (normed.float() * F.silu(z.float().reshape(-1, hv, dv))).to(h.dtype)
    return ops.linear_residual(gated.reshape(h.shape[0], hv * dv), linears["out_proj"], h)
