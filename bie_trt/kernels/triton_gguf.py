"""Triton linear over GGUF blocks: y = x · Wᵀ (+ bias) (+ residual) with W in the file's own bytes
(`gguf_blocks.py`, whose `block_linear_ref` is the twin).

One program owns BLOCK_M rows of x and BLOCK_N output rows, and walks K 32 weights at a time: every
format's blocks split into runs of 32 weights that share their scale data (a Q4_K / Q5_K sub-block,
two Q6_K scale groups, a whole Q4_0..Q8_0 block), so a step loads one run of each of its rows, turns
the bytes into fp32 weights with the format's own arithmetic (the twin's order of operations), and
multiplies them on the tensor cores in x's dtype. The format is a compile-time constant: one kernel
per format, no branches in the loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gguf_blocks import BLOCK_FORMATS, BlockWeight, format_id

RUN = 32   # weights a step
_FMT = {name: format_id(name) for name in BLOCK_FORMATS}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (tl.constexpr(_FMT[n]) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))
Q4_K, Q5_K, Q6_K = (tl.constexpr(_FMT[n]) for n in ("Q4_K", "Q5_K", "Q6_K"))
F32, F16, BF16 = (tl.constexpr(_FMT[n]) for n in ("F32", "F16", "BF16"))


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _half(ptr):
    """Two little-endian bytes at ptr -> the fp16 they spell, as fp32."""
    bits = _byte(ptr) | (_byte(ptr + 1) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int8(v):
    return tl.where(v >= 128, v - 256, v)


@triton.jit
def _run(rows, c, j, FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Weights 32c .. 32c+31 of each row as fp32 [BN, 32]; rows [BN, 1] point at each row's first byte,
    j is arange(32) [1, 32]."""
    if FMT == F32 or FMT == F16 or FMT == BF16:
        if FMT == F32:
            p = rows + (c * RUN + j) * 4
            bits = _byte(p) | (_byte(p + 1) << 8) | (_byte(p + 2) << 16) | (_byte(p + 3) << 24)
            w = bits.to(tl.float32, bitcast=True)
        elif FMT == F16:
            w = _half(rows + (c * RUN + j) * 2)
        else:
            p = rows + (c * RUN + j) * 2
            w = ((_byte(p) | (_byte(p + 1) << 8)) << 16).to(tl.float32, bitcast=True)
    elif FMT == Q4_K or FMT == Q5_K or FMT == Q6_K:
        blk = rows + (c // 8) * BLOCK_BYTES
        s = c % 8
        if FMT == Q6_K:
            h = s // 4
            r = s % 4
            low = (_byte(blk + 64 * h + 32 * (r % 2) + j) >> (4 * (r // 2))) & 0xF
            high = (_byte(blk + 128 + 32 * h + j) >> (2 * r)) & 3
            sc = _int8(_byte(blk + 192 + 8 * h + 2 * r + j // 16)).to(tl.float32)
            w = (_half(blk + 208) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
        else:
            # ggml's get_scale_min_k4 for sub-block s (bytes 4..15 of the block)
            lo4 = s < 4
            a = _byte(blk + 4 + s)                            # scales[s]
            b = _byte(blk + 8 + s)                            # scales[s + 4]
            a4 = _byte(blk + 4 + tl.where(lo4, s, s - 4))     # scales[s - 4] (s >= 4)
            sc = tl.where(lo4, a & 63, (b & 0xF) | ((a4 >> 6) << 4))
            mn = tl.where(lo4, b & 63, (b >> 4) | ((a >> 6) << 4))
            if FMT == Q4_K:
                q = (_byte(blk + 16 + 32 * (s // 2) + j) >> (4 * (s % 2))) & 0xF
            else:
                q = ((_byte(blk + 48 + 32 * (s // 2) + j) >> (4 * (s % 2))) & 0xF) \
                    | (((_byte(blk + 16 + j) >> s) & 1) << 4)
            w = (_half(blk) * sc.to(tl.float32)) * q.to(tl.float32) - _half(blk + 2) * mn.to(tl.float32)
    else:
        blk = rows + c * BLOCK_BYTES
        half = j % 16
        shift = 4 * (j // 16)
        if FMT == Q8_0:
            w = _half(blk) * _int8(_byte(blk + 2 + j)).to(tl.float32)
        elif FMT == Q4_0:
            w = _half(blk) * (((_byte(blk + 2 + half) >> shift) & 0xF) - 8).to(tl.float32)
        elif FMT == Q4_1:
            w = _half(blk) * ((_byte(blk + 4 + half) >> shift) & 0xF).to(tl.float32) + _half(blk + 2)
        elif FMT == Q5_0:
            q = ((_byte(blk + 6 + half) >> shift) & 0xF) | (((_byte(blk + 2 + j // 8) >> (j % 8)) & 1) << 4)
            w = _half(blk) * (q - 16).to(tl.float32)
        else:   # Q5_1
            q = ((_byte(blk + 8 + half) >> shift) & 0xF) | (((_byte(blk + 4 + j // 8) >> (j % 8)) & 1) << 4)
            w = _half(blk) * q.to(tl.float32) + _half(blk + 2)
    return w


@triton.jit
def _gguf_linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_r, stride_y,
                        FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, RUN)
    # rows past N read row N-1 again (always in bounds); their results are never stored
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, K // RUN):
        x = tl.load(x_ptr + rm[:, None] * stride_x + c * RUN + j[None, :], mask=rm[:, None] < M, other=0.0)
        w = _run(rows, c, j[None, :], FMT, BLOCK_BYTES)
        if IEEE:   # fp32 activations (the tests): no tf32 rounding of the weights
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    if HAS_RESIDUAL:   # added in the activation dtype, as the twin's `linear + residual`
        out += tl.load(r_ptr + rm[:, None] * stride_r + rn[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], out, mask=mask)


def block_linear_triton(x: torch.Tensor, w: BlockWeight, residual: torch.Tensor | None = None,
                        block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """x [M, K] -> [M, N] (+ residual [M, N]); one launch per part, writing its columns of y."""
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty((m, w.out_features), device=x.device, dtype=x.dtype)
    col = 0
    for part in w.parts:
        n = part.raw.shape[0]
        out = y[:, col:col + n]
        bias = w.bias[col:col + n].to(x.dtype) if w.bias is not None else None
        res = residual[:, col:col + n] if residual is not None else None
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gguf_linear_kernel[grid](
            x, part.raw, bias if bias is not None else x, res if res is not None else x, out, m, n, k,
            x.stride(0), part.raw.stride(0), res.stride(0) if res is not None else 0, y.stride(0),
            FMT=format_id(part.fmt), BLOCK_BYTES=BLOCK_FORMATS[part.fmt][1], HAS_BIAS=bias is not None,
            HAS_RESIDUAL=res is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n)
        col += n
    return y
