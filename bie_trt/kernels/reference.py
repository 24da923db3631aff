"""Plain-torch reference twins of the small kernels: the CPU path and the oracle for Triton."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kv.pool import KVPools
from ..kv.rotation import rotate
from . import key_offset
from .rope import Rope, cos_sin
from .w4_layout import W4Weight


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual): the residual add fused in front of the norm."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype), x


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)   # in place: one [T, I] buffer, as the fused kernel has


def glu_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate)·up of a gate_up output: act "silu" (Llama) or "gelu_tanh" (Gemma's gelu_pytorch_tanh)."""
    if act == "silu":
        return silu_mul_ref(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def w4_linear_ref(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    return F.linear(x, w.dense(x.dtype), None if w.bias is None else w.bias.to(x.dtype))


def write_kv_ref(pools: KVPools, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store k, v [T, H_kv, D]: token t goes to FP16 block slot_blocks[t], offset slot_offsets[t]."""
    pools.k[layer, slot_blocks, :, slot_offsets] = k.to(pools.k.dtype)
    pools.v[layer, slot_blocks, :, slot_offsets] = v.to(pools.v.dtype)


class QKNorm(NamedTuple):
    """Qwen3's RMSNorm of every q and k head over head_dim: weights [D] each, and its eps."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float


def qkv_epilogue_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                     inv_freq: torch.Tensor, key_mean: torch.Tensor | None, rotate_keys: bool, rotate_values: bool,
                     pools: KVPools, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                     qk_norm: QKNorm | None = None, key_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The qkv projection's rows [T, (H_q + 2 H_kv) D] -> attention's q [T, H_q, D] and, with key_mean, the
    offset coefficients [T, H_q, D] (key_offset.py); K and V into the cache.

    With qk_norm, each q and k head RMS-normalised first; the calibrated pre-RoPE mean key subtracted from k
    (key_mean [H_kv, D], or None); RoPE on q and k (rotate-half convention, cos and sin rounded to the activation
    dtype); q's offset coefficients against the mean; keys divided by the calibrated per-pair scale and queries
    multiplied by their KV head's (key_scale [H_kv, D], or None), then the Hadamard rotation of q and k (and of v
    with rotate_values), and K/V written to their FP16-tail slots."""
    D = pools.k.shape[-1]
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k = q.reshape(T, num_heads, D), k.reshape(T, num_kv_heads, D)
    if qk_norm is not None:
        q, k = rms_norm_ref(q, qk_norm.q, qk_norm.eps)[0], rms_norm_ref(k, qk_norm.k, qk_norm.eps)[0]
    if key_mean is not None:   # before RoPE: the cache holds R(p)(k - m), attention adds q·R(p)m back
        k = k - key_mean.to(k.dtype)
    cos, sin = cos_sin(positions, inv_freq, qkv.dtype)
    q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
    v = v.view(T, num_kv_heads, D)
    offset = key_offset.coefficients(q, key_mean) if key_mean is not None else None
    if key_scale is not None:   # (q·s)·(k/s) = q·k: the scale only moves where INT4 spends its range
        q = q * key_scale.repeat_interleave(num_heads // num_kv_heads, dim=0)
        k = k / key_scale
    if rotate_keys:   # rotated keys quantise without outlier channels; rotating q too keeps q·k
        q, k = rotate(q), rotate(k)
    if rotate_values:
        v = rotate(v)
    write_kv_ref(pools, layer, k, v, slot_blocks, slot_offsets)
    return q, offset
