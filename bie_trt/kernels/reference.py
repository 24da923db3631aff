"""Plain-torch reference twins of the small kernels: the CPU path and the oracle for Triton."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..kv.pool import KVPools, decode_block
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
    return F.silu(gate) * up


def w4_linear_ref(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    return F.linear(x, w.dense(x.dtype), None if w.bias is None else w.bias.to(x.dtype))


def write_kv_ref(pools: KVPools, layer: int, k: torch.Tensor, v: torch.Tensor,
                 block_table: Sequence[int], positions: torch.Tensor) -> None:
    """Store k, v [T, H_kv, D] at their positions; those blocks must be FP16 (the tail is never quantised)."""
    bs = pools.cfg.block_size
    pos = positions.tolist()
    entries = [block_table[p // bs] for p in pos]
    if any(decode_block(e)[0] for e in entries):
        raise RuntimeError("write into a quantised KV block: the FP16 tail must cover every position written")
    idx = torch.tensor(entries, device=k.device)
    off = torch.tensor([p % bs for p in pos], device=k.device)
    pools.k[layer, idx, :, off] = k.to(pools.k.dtype)
    pools.v[layer, idx, :, off] = v.to(pools.v.dtype)
