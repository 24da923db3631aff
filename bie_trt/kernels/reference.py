"""Plain-torch reference twins of the small kernels: the CPU path and the oracle for Triton."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv.pool import KVPools
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


def w4_linear_ref(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    return F.linear(x, w.dense(x.dtype), None if w.bias is None else w.bias.to(x.dtype))


def write_kv_ref(pools: KVPools, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store k, v [T, H_kv, D]: token t goes to FP16 block slot_blocks[t], offset slot_offsets[t]."""
    pools.k[layer, slot_blocks, :, slot_offsets] = k.to(pools.k.dtype)
    pools.v[layer, slot_blocks, :, slot_offsets] = v.to(pools.v.dtype)
