"""Triton int8-row linear: logits = x · (q · scale)ᵀ straight from the int8 lm_head (`int8_rows.py`).

The lm_head of the 8 GB plans is 128256 × 4096 int8 codes (0.5 GB), the largest single read of a
decode step after the layers. Dequantising it in torch, even chunk by chunk, moves the head
several times (int8 in, fp16 out, fp16 in again for the matmul): about 4.5 GB a step. Here each
program reads a [BLOCK_V, BLOCK_K] tile of codes once, multiplies in registers and applies the
row scale at the end, so a step reads the codes once.

One kernel, two inner products chosen at compile time: a single row (decode at batch 1) is a
chain of FMAs reduced across the tile; 2..16 rows (batched decode) go through `tl.dot` on a
16-row tile. Codes become fp16 by bit operations, not a conversion instruction (`_codes_f16`;
|q| <= 127 is exact in fp16). Larger M
(every position's logits, for evaluation) is compute-bound and stays with torch. The twin is
`Int8Rows.linear`.

The model's final RMSNorm rides in front (`norm_weight`), as in the W4 GEMV and with its helpers:
each program computes the rows' 1/rms and normalises x step by step, so the step's last norm is
no launch of its own. Twin: `rms_norm_ref`, then `Int8Rows.linear`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_rows import Int8Rows
from .triton_w4 import _normed, _row_rstd

MAX_ROWS = 16   # the one tl.dot tile's rows; more rows take the torch path


@triton.jit
def _codes_f16(w):
    """int8 codes -> exact fp16 without an int-to-float conversion: q + 128 as the low byte of the
    half 0x6400 | b (= 1024 + b), minus 1152 (the magic-number trick of the W4 nibble path)."""
    b = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16)
    return (b | 0x6400).to(tl.float16, bitcast=True) - 1152.0


@triton.jit(do_not_specialize=["M"])
def _int8_rows_kernel(x_ptr, q_ptr, s_ptr, out_ptr, nw_ptr, M, V, K, stride_x, stride_q, stride_o, eps,
                      NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < V
    # 64-bit: 128256 rows x 4096 codes passes 2**31 bytes.
    w_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    ks = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_V], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    if NORM:
        # Every program computes the rows' 1/rms itself: a few KB from L2 against its tile of codes.
        rstd = _row_rstd(x_ptr, ms, ms < M, stride_x, K, eps, 1024 if BLOCK_M == 1 else 256)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        # Past K, x is 0 and the norm weight is read at column 0: nothing is read out of bounds.
        k_in = tl.where(k_ok, k0 + ks, 0)
        if BLOCK_M == 1:
            x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0)
            if NORM:
                x = tl.reshape(_normed(x[None, :], rstd, nw_ptr, k_in, x_ptr.dtype.element_ty), (BLOCK_K,))
            acc += tl.sum(_codes_f16(w).to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        else:
            x = tl.load(x_ptr + ms[:, None] * stride_x + (k0 + ks)[None, :],
                        mask=(ms[:, None] < M) & k_ok[None, :], other=0)
            if NORM:
                x = _normed(x, rstd, nw_ptr, k_in, x_ptr.dtype.element_ty)
            acc += tl.dot(x, tl.trans(_codes_f16(w).to(x.dtype)), input_precision=DOT_PRECISION)
    scale = tl.load(s_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    if BLOCK_M == 1:
        tl.store(out_ptr + rows, (acc * scale).to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(out_ptr + ms[:, None] * stride_o + rows[None, :], (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
                 mask=(ms[:, None] < M) & row_ok[None, :])


def int8_rows_linear_triton(x: torch.Tensor, head: Int8Rows, block_v: int = 64, block_k: int = 128,
                            num_warps: int = 4, *, norm_weight: torch.Tensor | None = None,
                            eps: float = 0.0) -> torch.Tensor:
    """x [M, K] (fp16 or fp32, M <= 16) -> x · Wᵀ [M, V] in x's dtype; twin of `Int8Rows.linear`.

    With `norm_weight`, x is RMS-normalised first (the model's final norm, one launch for both):
    twin `Int8Rows.linear(rms_norm_ref(x, norm_weight, eps)[0])`."""
    M, K = x.shape
    V = head.q.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"the int8 kernel takes at most {MAX_ROWS} rows; got {M} (use Int8Rows.linear).")
    if head.q.shape[1] != K or head.q.stride(1) != 1:
        raise ValueError(f"x has {K} features; the int8 head is {tuple(head.q.shape)} (needs a unit stride along K).")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}; the int8 head needs ({K},).")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((M, V), dtype=x.dtype, device=x.device)
    nw = norm_weight if norm_weight is not None else head.scale   # never read without NORM
    _int8_rows_kernel[(triton.cdiv(V, block_v),)](
        x, head.q, head.scale, out, nw, M, V, K, x.stride(0), head.q.stride(0), out.stride(0), eps,
        NORM=norm_weight is not None, BLOCK_M=1 if M == 1 else MAX_ROWS, BLOCK_V=block_v, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return out
