"""Gemma 4's attention differences on the way into the cache, as plain torch around the qkv epilogue: values
RMS-normalised per head without a weight (from the keys' projection where a layer has no v_proj), and the
query of a KV-shared layer, which projects, normalises and turns only q and reads another layer's cache."""
from __future__ import annotations

import torch

from ..kernels.key_offset import KeyOffset, coefficients
from ..kernels.rope import Rope, cos_sin
from ..kv.rotation import rotate


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def with_normed_values(qkv: torch.Tensor, q_size: int, kv_heads: int, head_dim: int, k_eq_v: bool,
                       eps: float) -> torch.Tensor:
    """qkv rows [q | k | v] (or [q | k] where keys are values) -> [q | k | unit-RMS v per head]: the epilogue
    then norms and turns k and writes v as it is. With k_eq_v the values are the keys' projection before the
    key norm and RoPE."""
    kv_size = kv_heads * head_dim
    v = qkv[:, q_size:q_size + kv_size] if k_eq_v else qkv[:, q_size + kv_size:]
    v = _unit_rms(v.unflatten(-1, (kv_heads, head_dim)), eps).flatten(-2)
    return torch.cat([qkv[:, :q_size + kv_size], v], dim=-1)


def shared_query(q: torch.Tensor, num_heads: int, q_norm: torch.Tensor, eps: float, positions: torch.Tensor,
                 inv_freq: torch.Tensor, rotate_q: bool, key_scale: torch.Tensor | None = None,
                 key_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, KeyOffset | None]:
    """A KV-shared layer's q rows [T, H_q x D] -> attention's q [T, H_q, D]: normed, turned, multiplied by the
    source layer's key scale (key_scale [H_kv, D], or None) and rotated as the cache's keys are; with the
    source layer's keys centred (key_mean [H_kv, D], its pre-RoPE mean), what attention adds back for them
    (key_offset.py). Nothing is written: the layer owns no cache."""
    q = q.unflatten(-1, (num_heads, -1))
    qf = q.float()
    q = (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + eps) * q_norm.float()).to(q.dtype)
    cos, sin = cos_sin(positions, inv_freq, q.dtype)
    q = Rope.apply(q, cos, sin)
    offset = KeyOffset(coefficients(q, key_mean), inv_freq) if key_mean is not None else None
    if key_scale is not None:
        q = q * key_scale.repeat_interleave(num_heads // key_scale.shape[0], dim=0)
    return rotate(q) if rotate_q else q, offset
