"""Quantisers of the mixed-precision KV cache, as plain torch over tensors whose last dim is head_dim.

These are the reference twins of the fused GPU kernels and what the CPU runtime
runs. Layouts follow `pool.py` exactly:
  INT4 asym  packed uint8 [..., D // 2] (channel 2j low nibble, 2j+1 high),
             scale and zero fp16 [..., D // G];  x ≈ q · scale + zero, q in 0..15
  FP8        float8_e4m3fn [..., D], scale fp16 [..., 1];  x ≈ q · scale
"""
from __future__ import annotations

import torch

from .pool import KVPools, decode_block

INT4_LEVELS = 15
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# The smallest normal fp16: a floor for scales so a constant (or all-zero) group or token
# never divides by zero, and scales never fall into fp16 subnormals.
_MIN_SCALE = torch.finfo(torch.float16).tiny


def quantize_int4_asym(
    x: torch.Tensor, group_size: int, shared_dims: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric INT4 per group of `group_size` consecutive channels -> (packed, scale, zero).

    `shared_dims` > 0 makes the last `shared_dims` leading dims share one range (the
    "block" scale-scope ablation); the stored layout is the same either way.
    """
    D = x.shape[-1]
    if D % 2 or D % group_size:
        raise ValueError(f"INT4 KV needs an even head_dim divisible by the group size; got {D} and {group_size}.")
    g = x.float().unflatten(-1, (D // group_size, group_size))
    lo, hi = g.amin(-1), g.amax(-1)
    if shared_dims:
        dims = tuple(range(-1 - shared_dims, 0))
        lo, hi = lo.amin(dims, keepdim=True).expand_as(lo), hi.amax(dims, keepdim=True).expand_as(hi)
    # Codes are computed against the *stored* fp16 zero and scale, so the bound
    # |x - x̂| <= scale / 2 holds for what the kernel actually dequantises with.
    # Rounding the zero down keeps every value at or above the grid's bottom even
    # when the input is not fp16-representable (the fp32 CPU pool); fp16 input is exact.
    zero = lo.half()
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -torch.inf)), zero)
    scale = ((hi - zero.float()) / INT4_LEVELS).clamp_min(_MIN_SCALE).half()
    q = ((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round().clamp(0, INT4_LEVELS)
    q = q.flatten(-2).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, zero


def dequantize_int4_asym(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_int4_asym`: q · scale + zero, computed in fp32, returned as `dtype`."""
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    g = q.unflatten(-1, (q.shape[-1] // group_size, group_size))
    x = g * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp16 scale per token per head (absmax / 448) -> (q, scale)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE).half()
    # The fp16 scale may round below absmax/448; clamp rather than rely on how a
    # backend casts out-of-range values (CPU torch saturates, others give NaN).
    q = (xf / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quantize_block(pools: KVPools, layer: int | None, fp_block: int | list[int], q_block: int | list[int]) -> None:
    """Quantise FP16 block `fp_block` into quantised block `q_block`, K and V, in one layer or all (None).
    Lists of blocks quantise each into its partner.

    Called when a block falls wholly out of the recent window. Keys in the FP16
    pool are already rotated when rotation is on, so none happens here.
    """
    if pools.k_q is None:
        raise ValueError(f"the KV cache ({pools.cfg.dtype}) has no quantised pool to quantise into.")
    layers = slice(None) if layer is None else layer
    for side in ("k", "v"):
        src = getattr(pools, side)[layers, fp_block]
        if pools.cfg.dtype == "int4_asym":
            shared = 2 if pools.cfg.scale_scope == "block" else 0   # heads and tokens of the block
            packed, scale, zero = quantize_int4_asym(src, pools.cfg.group_size, shared)
            getattr(pools, f"{side}_zero")[layers, q_block] = zero
        else:
            packed, scale = quantize_fp8(src)
        getattr(pools, f"{side}_q")[layers, q_block] = packed
        getattr(pools, f"{side}_scale")[layers, q_block] = scale


def dequantize_blocks(pools: KVPools, layer: int, entries: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of the blocks that block-table entries name, in order, each [H_kv, n·B, D] fp32."""
    decoded = [decode_block(e) for e in entries]
    fp_pos = [i for i, (quantised, _) in enumerate(decoded) if not quantised]
    q_pos = [i for i, (quantised, _) in enumerate(decoded) if quantised]
    out = []
    for side in ("k", "v"):
        fp_pool = getattr(pools, side)
        blocks = torch.empty((len(entries),) + tuple(fp_pool.shape[2:]), dtype=torch.float32, device=fp_pool.device)
        if fp_pos:
            blocks[fp_pos] = fp_pool[layer, [decoded[i][1] for i in fp_pos]].float()
        if q_pos:
            ids = [decoded[i][1] for i in q_pos]
            q = getattr(pools, f"{side}_q")[layer, ids]
            scale = getattr(pools, f"{side}_scale")[layer, ids]
            if pools.cfg.dtype == "int4_asym":
                zero = getattr(pools, f"{side}_zero")[layer, ids]
                blocks[q_pos] = dequantize_int4_asym(q, scale, zero, pools.cfg.group_size)
            else:
                blocks[q_pos] = dequantize_fp8(q, scale)
        out.append(blocks.transpose(0, 1).flatten(1, 2))   # [H_kv, n·B, D]
    return out[0], out[1]


def dequantize_block(pools: KVPools, layer: int, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of the block a block-table entry names, each [H_kv, B, D] fp32, from either pool."""
    return dequantize_blocks(pools, layer, [entry])
