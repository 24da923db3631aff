"""AutoAWQ "gemm" packing and round-to-nearest 4-bit quantisation.

qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales fp16 [in/G, out].
Nibble slot i (bits 4i..4i+3) of packed column c holds logical column 8c + AWQ_ORDER[i].
W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # slot -> logical column within 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # logical column -> slot
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> uint8 [rows, cols] in logical column order."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [rows, cols/8, slot]
    logical = nibbles[..., list(AWQ_REVERSE_ORDER)]
    return logical.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8/int [rows, cols] with values 0..15 -> int32 [rows, cols/8] in AWQ slot order."""
    rows, cols = q.shape
    slots = q.to(torch.int32).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    return (slots << _SHIFTS.to(q.device)).sum(-1, dtype=torch.int64).to(torch.int32)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """-> float32 W [in, out]."""
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float().repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return (q - z) * s


def quantize_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit of W [in, out] (a transposed nn.Linear weight).

    Returns AWQ gemm tensors (qweight, qzeros, scales). Groups run along `in`.
    """
    k, n = w.shape
    g = w.float().reshape(k // group_size, group_size, n)
    lo = g.amin(dim=1).clamp(max=0.0)  # include 0 so an all-positive group still represents 0 exactly
    hi = g.amax(dim=1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    s = scale.float()
    zero = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(g / s.unsqueeze(1) + zero.unsqueeze(1)).clamp(0, 15).to(torch.uint8).reshape(k, n)
    return awq_pack(q), awq_pack(zero.to(torch.uint8)), scale
