"""Qwen3.5's Gated DeltaNet token mixer: the linear-attention sub-block of the decoder's "linear_attention"
layers, in place of attention (the MLP around it is the decoder's own).

    x            = rms_norm(h) @ in_proj          one fused W4 linear: [q k v | z | b | a]
    q, k, v      = silu(causal_conv(q k v))       depthwise, kernel W (4), over the sequence's last W-1 inputs too
    g            = -exp(A_log) * softplus(a + dt_bias)      the per-head log decay (<= 0)
    beta         = sigmoid(b)                                how much of each token is written
    o            = delta_rule(l2norm(q), l2norm(k), v, g, beta)   kernels/delta_rule.py
    h           += out_proj(rms_norm_per_head(o) * w * silu(z))

The conv inputs and the delta state live in the sequence's recurrent slot (kv/recurrent.py). A speculative
verify logs the state before it and its rows' inputs, so that `roll_back` can keep only the accepted rows
without running the model again; a prompt chunk that saves its state at block boundaries (SeqInput.save_states)
runs its rows in parts cut there, copying the state into a snapshot slot after each."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import ops
from ..kernels.delta_rule import causal_conv, causal_conv_step, delta_rule_inputs
from ..kernels.step_inputs import StepMetadata
from ..kernels.w4_layout import W4Weight
from ..kv.recurrent import RecurrentStates, StepLog, conv_channels

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


def _delta_inputs(cfg: ModelConfig, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's outputs [T, C] -> the delta rule's q, k [T, H_v, K] (normalised, q scaled) and v [T, H_v, V]."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = delta_rule_inputs(q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), hv)
    return q, k, v.reshape(-1, hv, dv).float()


def _advance(cfg: ModelConfig, li: int, w: DeltaNetWeights, states: RecurrentStates, slot: int, mixed: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One sequence's rows (their conv inputs, decays and write strengths) through the conv and the delta rule
    from its slot, the slot advanced past them: their outputs [T, H_v, V] fp32."""
    conv, states.conv[li, slot] = causal_conv(mixed, w.conv, states.conv[li, slot])
    q, k, v = _delta_inputs(cfg, conv)
    slots = torch.tensor([slot], device=mixed.device)
    return ops.gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], states.delta[li], slots)[0]


def roll_back(cfg: ModelConfig, li: int, w: DeltaNetWeights, states: RecurrentStates, slot: int, keep: int) -> None:
    """Layer-in-group `li`'s state of `slot` as after the first `keep` rows of its logged step (a verify whose
    later proposals were rejected): the state before the step, advanced through those rows again."""
    log = states.logs[slot].pop(li)
    states.conv[li, slot], states.delta[li, slot] = log.conv, log.delta
    if keep:
        _advance(cfg, li, w, states, slot, log.inputs[:keep], log.g[:keep], log.beta[:keep])


def deltanet_block(cfg: ModelConfig, li: int, w: DeltaNetWeights, linears: dict[str, W4Weight],
                   attn_norm: torch.Tensor, h: torch.Tensor, meta: StepMetadata,
                   states: RecurrentStates) -> torch.Tensor:
    """h + the DeltaNet sub-block of layer-in-group `li` over the step's rows; each sequence's slot read and
    advanced past its rows."""
    if meta.recurrent is None:
        raise ValueError("a model with linear-attention layers needs every input's state_slot")
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    x = ops.norm_linear(h, attn_norm, cfg.rms_norm_eps, linears["in_proj"])
    mixed, z, b, a = x.split([conv_channels(cfg), hv * dv, hv, hv], dim=-1)
    g = -w.A_log.exp() * F.softplus(a.float() + w.dt_bias)
    beta = torch.sigmoid(b.float())
    out = torch.empty(h.shape[0], hv, dv, dtype=torch.float32, device=h.device)
    if meta.recurrent_decode is not None:   # the decode batch: one conv step, one delta-rule call
        rows, slots = meta.recurrent_decode
        q, k, v = _delta_inputs(cfg, causal_conv_step(mixed[rows], w.conv, states.conv[li], slots))
        out[rows] = ops.gated_delta_rule(q[:, None], k[:, None], v[:, None], g[rows, None], beta[rows, None],
                                         states.delta[li], slots)[:, 0]
    for row, n, slot in meta.recurrent:     # each chunk (or part of a sequence cut into several) on its own
        part = slice(row, row + n)
        if slot in meta.recurrent_log:   # a speculative verify: what rolling part of it back needs
            states.log(slot, li, StepLog(states.conv[li, slot].clone(), states.delta[li, slot].clone(),
                                         mixed[part].clone(), g[part].clone(), beta[part].clone()))
        done = 0
        for end, snap in [*meta.recurrent_saves.get(row, ()), (n, None)]:   # cut where a state is saved
            if end > done:
                piece = slice(row + done, row + end)
                out[piece] = _advance(cfg, li, w, states, slot, mixed[piece], g[piece], beta[piece])
                done = end
            if snap is not None:   # the state after the first `end` rows, kept for a returning prompt
                states.conv[li, snap], states.delta[li, snap] = states.conv[li, slot], states.delta[li, slot]
    # the gated per-head RMSNorm (as transformers rounds it): the outputs in the activation dtype, normalised in
    # fp32, scaled by w in the activation dtype, gated by silu(z) in fp32
    o = out.to(h.dtype).float()
    normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(h.dtype) * w.norm
    gated = (normed.float() * F.silu(z.float().reshape(-1, hv, dv))).to(h.dtype)
    return ops.linear_residual(gated.reshape(h.shape[0], hv * dv), linears["out_proj"], h)
