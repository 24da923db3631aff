"""Triton W4A16 linear: y = x · Wᵀ (+ bias) straight from the runtime 4-bit layout (`w4_layout.py`).

Two kernels, picked by the number of rows M of x (`w4_linear_ref` in reference.py is the twin):

* **GEMV, M = 1** (decode). Bound by reading the weights once, so its job is to keep HBM busy
  with as few instructions per weight as possible. A thread owns four consecutive words of each
  of its rows (one 16-byte load, 32 weights) and the 32 x values they multiply (four more);
  the math runs on *nibble planes* (plane i of a word tile holds weights k = 8·word + i, and x
  is split into the matching planes), so the dot product is a plain chain of FMAs and threads
  only exchange data once per step. Triton does not software-pipeline a loop without `tl.dot`,
  so the next step's weights are requested by hand while the current step computes.
* **MMA, M ≥ 2** (batched decode, speculative verification, prefill chunks). The weight tile
  is dequantised in registers and multiplied on the tensor cores. With 2..8 rows the tile is
  padded to 16 rows: compiled for sm_90, an FMA GEMV costs about 15 instructions per weight at
  M = 4 against about 6 here, because the tensor cores take over the per-row multiply-adds.

Both split K when there are too few output tiles to fill the GPU: each K-slice writes fp32
partial sums to a workspace, and the last slice of a tile to arrive (an atomic counter per tile,
which that slice sets back to 0) adds them up in a fixed order (deterministic, unlike atomic sums)
and finishes the tile: no second launch. A K-step never straddles a quantisation group (BLOCK_K
divides the group size), so a step needs one scale and one zero per output row, not one per weight.

The decoder layer's small ops ride along, so a layer is one launch per linear: an RMSNorm of the
input (each program computes the row's 1/rms itself; the row is a few KB from L2) in front of the
qkv and gate_up linears, the residual add behind o_proj and down, and SiLU(gate)·up behind gate_up
(a program then owns matching gate and up rows, interleaved: local row 2r is gate row r, 2r + 1
up row r). Twins: `rms_norm_ref`, `silu_mul_ref` and `+` around `w4_linear_ref` (`ops.py`).

Tile sizes obey two rules found by compiling for sm_90 and reading the SASS: a [BLOCK_K] or
[BLOCK_N] vector loaded every step must have fewer elements than the program has threads, or
Triton loads it once and reshuffles it through shared memory with barriers in the loop; and
nibble masks arrive as a run-time argument, because as immediates ptxas re-creates one in a
register before every use (about one extra instruction per weight).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .arrival import arrival_counters
from .w4_layout import W4Weight, pack_w4

_GEMV_KEYS = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps"}
_MMA_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}
_NIBBLE_MASK = 0xF


@triton.jit
def _nibble(words, i: tl.constexpr, zero, nib_mask, FLOAT_ZERO: tl.constexpr):
    """(q - z) in fp32 for nibble i of every word [BN, BKW]; zero is [BN], nib_mask is 0xF.

    Masking a nibble in place (bits 4p..4p+3) and OR-ing in the exponent of 2^(23 - 4p) gives the
    bit pattern of the fp32 number 2^(23 - 4p) + q, so one logic op and one exact subtraction
    replace a shift, a mask and an int->float conversion (a quarter-rate instruction). Nibbles
    5..7 would overlap the exponent field, so they are first moved down by 12 bits to p = 2..4
    (one shift, shared by all three). An integer zero folds into that subtraction exactly; a
    fractional one (FLOAT_ZERO: fp16 zeros, a GGUF's Q4_1/Q4_K minimum) would be rounded to the
    2^(23 - 4p) grid there, so it is subtracted after: one more subtraction per weight.
    """
    SHIFT: tl.constexpr = 12 if i >= 5 else 0
    POS: tl.constexpr = i - SHIFT // 4
    bits = ((words >> SHIFT) & (nib_mask << (4 * POS))) | ((150 - 4 * POS) << 23)
    if FLOAT_ZERO:
        return (bits.to(tl.float32, bitcast=True) - (1 << (23 - 4 * POS))) - zero[:, None]
    return bits.to(tl.float32, bitcast=True) - ((1 << (23 - 4 * POS)) + zero[:, None])


@triton.jit
def _split_planes(x):
    """x [8·W] -> (x0, ..., x7), each [W] with xi[j] = x[8j + i]; only renumbers registers."""
    e, o = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
    ee, eo = tl.split(tl.reshape(e, (e.shape[0] // 2, 2)))
    oe, oo = tl.split(tl.reshape(o, (o.shape[0] // 2, 2)))
    x0, x4 = tl.split(tl.reshape(ee, (ee.shape[0] // 2, 2)))
    x2, x6 = tl.split(tl.reshape(eo, (eo.shape[0] // 2, 2)))
    x1, x5 = tl.split(tl.reshape(oe, (oe.shape[0] // 2, 2)))
    x3, x7 = tl.split(tl.reshape(oo, (oo.shape[0] // 2, 2)))
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _load_step(qw_ptr, s_ptr, z_ptr, offs_n, offs_w, kw, live_rows, stride_qn, stride_sn,
               GROUP: tl.constexpr):
    """One K-step's packed words [BN, BKW] and its group's scale and zero [BN], for rows < live_rows, as
    stored: a step read ahead is converted where it is used, or the read is waited for at once."""
    words = _load_words(qw_ptr, offs_n, offs_w, kw, live_rows, stride_qn)
    scale, zero = _load_group(s_ptr, z_ptr, offs_n, kw, live_rows, stride_sn, GROUP)
    return words, scale, zero


@triton.jit
def _load_words(qw_ptr, offs_n, offs_w, kw, live_rows, stride_qn):
    """One K-step's packed words [BN, BKW] from word kw, for rows < live_rows (read once: evicted first)."""
    return tl.load(qw_ptr + offs_n[:, None] * stride_qn + (kw + offs_w)[None, :],
                   mask=(offs_n < live_rows)[:, None], other=0, eviction_policy="evict_first")


@triton.jit
def _load_group(s_ptr, z_ptr, offs_n, kw, live_rows, stride_sn, GROUP: tl.constexpr):
    """The scale and zero [BN] of the group holding packed word kw, for rows < live_rows, as stored."""
    mask = offs_n < live_rows
    group = kw * 8 // GROUP
    scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=mask, other=0)
    zero = tl.load(z_ptr + offs_n * stride_sn + group, mask=mask, other=0)
    return scale, zero


@triton.jit
def _load_k(ptr, kw, offs_k, kw_end):
    """[BK] of a K-long vector (x, the norm weights) at packed word kw, as stored; 0 at or past kw_end."""
    k = kw * 8 + offs_k
    return tl.load(ptr + k, mask=k < kw_end * 8, other=0)


@triton.jit
def _row_rstd(x_ptr, offs_m, mask_m, stride_xm, K, eps, BLOCK: tl.constexpr):
    """1/rms of each row [BM] of x: the RMSNorm folded into the linear that consumes it."""
    acc = tl.zeros([offs_m.shape[0], BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs)[None, :],
                    mask=mask_m[:, None] & (k0 + offs < K)[None, :], other=0).to(tl.float32)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _normed(x, rstd, nw_ptr, offs_k, DTYPE: tl.constexpr):
    """x [BM, BK] -> norm(x) · weight rounded to the activation dtype, as the standalone norm stores it."""
    return _norm_times(x, rstd, tl.load(nw_ptr + offs_k), DTYPE)


@triton.jit
def _norm_times(x, rstd, w, DTYPE: tl.constexpr):
    """`_normed` with the norm weights w [BK] already read."""
    return (x.to(tl.float32) * rstd[:, None] * w.to(tl.float32)[None, :]).to(DTYPE)


@triton.jit
def _weight_rows(pid_n, BLOCK_N: tl.constexpr, N, GLU: tl.constexpr):
    """(weight rows, output columns) of a program's BLOCK_N rows. GLU: gate and up rows interleaved."""
    r = tl.arange(0, BLOCK_N)
    if GLU:
        col = pid_n * (BLOCK_N // 2) + r // 2
        return col + (r % 2) * (N // 2), col
    return pid_n * BLOCK_N + r, pid_n * BLOCK_N + r


@triton.jit
def _last_slice_sum(acc, part_ptr, cnt_ptr, tile, part_off, pid_k, SPLIT_K: tl.constexpr, stride_part, mask):
    """Split K: store this slice's partials; the tile's last slice to arrive sums all of them in
    slice order and gets (True, sum), the others (False, _). The counter is reset for the next launch."""
    tl.store(part_ptr + pid_k * stride_part + part_off, acc, mask=mask)
    tl.debug_barrier()   # every thread's partials are out before the arrival is counted
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT_K):
            # .cg: other programs wrote these, so read them from L2, not this SM's L1
            total += tl.load(part_ptr + s * stride_part + part_off, mask=mask, other=0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)
    return last, total


@triton.jit
def _epilogue(acc, offs_m, cols, mask_m, bias_ptr, bias_rows, res_ptr, out_ptr, stride_rm, stride_om, N_OUT,
              HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GLU: tl.constexpr):
    """acc [BM, BN] fp32 -> out: + bias, then SiLU(gate)·up (GLU) or + residual, in the output dtype."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + bias_rows).to(tl.float32)[None, :]
    if GLU:
        # The gate_up output is rounded to the activation dtype first, as the unfused path stores it.
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (acc.shape[0], acc.shape[1] // 2, 2)))
        y = (gate * tl.sigmoid(gate) * up).to(dtype)
        cols = tl.reshape(cols, (cols.shape[0] // 2, 2))
        cols, _ = tl.split(cols)
    else:
        y = acc.to(dtype)
    mask = mask_m[:, None] & (cols < N_OUT)[None, :]
    if RESIDUAL:
        # Added in the activation dtype, as the reference adds the residual stream.
        y = (y + tl.load(res_ptr + offs_m[:, None] * stride_rm + cols[None, :], mask=mask, other=0)).to(dtype)
    tl.store(out_ptr + offs_m[:, None] * stride_om + cols[None, :], y, mask=mask)


@triton.jit
def _w4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, nw_ptr, res_ptr,
    N, KW, KW_PER_SPLIT, nib_mask, stride_qn, stride_sn, eps,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GLU: tl.constexpr, FLOAT_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_N output rows × one K-slice of a single row of x."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, cols = _weight_rows(pid_n, BLOCK_N, N, GLU)
    offs_w = tl.arange(0, BLOCK_KW)
    row0 = tl.zeros([1], dtype=tl.int32)
    if NORM:
        rstd = _row_rstd(x_ptr, row0, row0 == 0, 0, KW * 8, eps, 1024)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # The loop runs over packed words, not K: K // 8 would lose the compiler's knowledge that
    # addresses are 16-byte aligned, and with it the vectorised loads.
    kw_start = pid_k * KW_PER_SPLIT
    kw_end = tl.minimum(kw_start + KW_PER_SPLIT, KW)
    words, scale, zero = _load_step(qw_ptr, s_ptr, z_ptr, offs_n, offs_w, kw_start,
                                    tl.where(kw_start < kw_end, N, 0), stride_qn, stride_sn, GROUP)
    x = _load_k(x_ptr, kw_start, offs_k, kw_end)
    nw = _load_k(nw_ptr, kw_start, offs_k, kw_end) if NORM else x
    for kw in range(kw_start, kw_end, BLOCK_KW):
        # Request the next step now (nothing past the slice's end) so it is in flight meanwhile: the
        # weights, their scales and zeros, and x (and the norm weights) too, an L2 read that every step
        # otherwise waited for.
        next_words, next_scale, next_zero = _load_step(
            qw_ptr, s_ptr, z_ptr, offs_n, offs_w, kw + BLOCK_KW,
            tl.where(kw + BLOCK_KW < kw_end, N, 0), stride_qn, stride_sn, GROUP)
        next_x = _load_k(x_ptr, kw + BLOCK_KW, offs_k, kw_end)
        next_nw = _load_k(nw_ptr, kw + BLOCK_KW, offs_k, kw_end) if NORM else next_x
        if NORM:
            x = tl.reshape(_norm_times(x[None, :], rstd, nw, x_ptr.dtype.element_ty), (BLOCK_K,))
        x0, x1, x2, x3, x4, x5, x6, x7 = _split_planes(x.to(tl.float32))
        z32 = zero.to(tl.float32)
        # Explicit FMAs: Triton is moving to no fp contraction by default.
        t = _nibble(words, 0, z32, nib_mask, FLOAT_ZERO) * x0[None, :]
        t = tl.fma(_nibble(words, 1, z32, nib_mask, FLOAT_ZERO), x1[None, :], t)
        t = tl.fma(_nibble(words, 2, z32, nib_mask, FLOAT_ZERO), x2[None, :], t)
        t = tl.fma(_nibble(words, 3, z32, nib_mask, FLOAT_ZERO), x3[None, :], t)
        t = tl.fma(_nibble(words, 4, z32, nib_mask, FLOAT_ZERO), x4[None, :], t)
        t = tl.fma(_nibble(words, 5, z32, nib_mask, FLOAT_ZERO), x5[None, :], t)
        t = tl.fma(_nibble(words, 6, z32, nib_mask, FLOAT_ZERO), x6[None, :], t)
        t = tl.fma(_nibble(words, 7, z32, nib_mask, FLOAT_ZERO), x7[None, :], t)
        # The group's scale multiplies the row sums, not every weight.
        acc += tl.sum(t, axis=1) * scale.to(tl.float32)
        words, scale, zero, x, nw = next_words, next_scale, next_zero, next_x, next_nw

    mask = offs_n < N
    bias_rows = tl.where(mask, offs_n, 0)
    if SPLIT_K > 1:
        last, total = _last_slice_sum(acc, part_ptr, cnt_ptr, pid_n, offs_n, pid_k, SPLIT_K, N, mask)
        if last:
            _epilogue(total[None, :], row0, cols, row0 == 0, bias_ptr, bias_rows, res_ptr, out_ptr, 0, 0,
                      N // 2 if GLU else N, HAS_BIAS, RESIDUAL, GLU)
    else:
        _epilogue(acc[None, :], row0, cols, row0 == 0, bias_ptr, bias_rows, res_ptr, out_ptr, 0, 0,
                  N // 2 if GLU else N, HAS_BIAS, RESIDUAL, GLU)


@triton.jit
def _w4_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, nw_ptr, res_ptr,
    M, N, KW, KW_PER_SPLIT, nib_mask, stride_xm, stride_qn, stride_sn, stride_om, stride_rm, eps,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GLU: tl.constexpr, FLOAT_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] output tile over one K-slice, on the tensor cores."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    # Program id 0 walks M fastest, so the programs sharing a weight tile run together and
    # read it from L2 rather than HBM.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, cols = _weight_rows(pid_n, BLOCK_N, N, GLU)
    offs_w = tl.arange(0, BLOCK_KW)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if NORM:
        rstd = _row_rstd(x_ptr, offs_m, mask_m, stride_xm, KW * 8, eps, 256)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kw_start = pid_k * KW_PER_SPLIT
    kw_end = tl.minimum(kw_start + KW_PER_SPLIT, KW)
    # The scales and zeros, 2-byte gathers that Triton's pipeliner does not prefetch, and the norm weights
    # are read a step ahead (nothing past the slice's end); the pipeliner prefetches x and the words.
    scale, zero = _load_group(s_ptr, z_ptr, offs_n, kw_start, tl.where(kw_start < kw_end, N, 0), stride_sn, GROUP)
    if NORM:
        nw = _load_k(nw_ptr, kw_start, offs_k, kw_end)
    for kw in range(kw_start, kw_end, BLOCK_KW):
        next_scale, next_zero = _load_group(s_ptr, z_ptr, offs_n, kw + BLOCK_KW,
                                            tl.where(kw + BLOCK_KW < kw_end, N, 0), stride_sn, GROUP)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (kw * 8 + offs_k)[None, :],
                    mask=mask_m[:, None], other=0)
        if NORM:
            next_nw = _load_k(nw_ptr, kw + BLOCK_KW, offs_k, kw_end)
            a = _norm_times(a, rstd, nw, x_ptr.dtype.element_ty)
            nw = next_nw
        words = _load_words(qw_ptr, offs_n, offs_w, kw, N, stride_qn)
        z32 = zero.to(tl.float32)
        # Three rounds of interleaving put weight k = 8·word + i back in K order; like the
        # splits in the GEMV, they only renumber registers.
        even = tl.interleave(
            tl.interleave(_nibble(words, 0, z32, nib_mask, FLOAT_ZERO), _nibble(words, 4, z32, nib_mask, FLOAT_ZERO)),
            tl.interleave(_nibble(words, 2, z32, nib_mask, FLOAT_ZERO), _nibble(words, 6, z32, nib_mask, FLOAT_ZERO)))
        odd = tl.interleave(
            tl.interleave(_nibble(words, 1, z32, nib_mask, FLOAT_ZERO), _nibble(words, 5, z32, nib_mask, FLOAT_ZERO)),
            tl.interleave(_nibble(words, 3, z32, nib_mask, FLOAT_ZERO), _nibble(words, 7, z32, nib_mask, FLOAT_ZERO)))
        w = tl.interleave(even, odd)
        if BLOCK_M < BLOCK_K:
            # Few rows: q - z is a small integer, exact in any float type, so the tensor cores
            # take it as is and the scale multiplies the smaller [BLOCK_M, BLOCK_N] product.
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION) * scale.to(tl.float32)[None, :]
        else:
            # Many rows: scaling each weight once is cheaper; (q - z) · s is rounded once to the
            # activation dtype, as the reference's dense weight is.
            w = (w * scale.to(tl.float32)[:, None]).to(a.dtype)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        scale, zero = next_scale, next_zero

    mask = mask_m[:, None] & mask_n[None, :]
    bias_rows = tl.where(mask_n, offs_n, 0)
    if SPLIT_K > 1:
        tile = pid_n * tl.num_programs(0) + pid_m
        last, total = _last_slice_sum(acc, part_ptr, cnt_ptr, tile, offs_m[:, None] * N + offs_n[None, :], pid_k,
                                      SPLIT_K, M * N, mask)
        if last:
            _epilogue(total, offs_m, cols, mask_m, bias_ptr, bias_rows, res_ptr, out_ptr, stride_rm, stride_om,
                      N // 2 if GLU else N, HAS_BIAS, RESIDUAL, GLU)
    else:
        _epilogue(acc, offs_m, cols, mask_m, bias_ptr, bias_rows, res_ptr, out_ptr, stride_rm, stride_om,
                  N // 2 if GLU else N, HAS_BIAS, RESIDUAL, GLU)


# --- Configs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemvTile:
    """A GEMV program's shape. `regs`: registers per thread the occupancy model assumes, the most
    any fused variant and split needs on sm_86/89/90 (`scripts/compile_check.py` fails if a
    compiled GEMV needs more)."""

    block_n: int
    block_k: int
    num_warps: int
    regs: int


# BLOCK_N and num_warps such that both per-step vectors stay below the thread count and every
# thread holds whole 16-byte vectors. Registers: the most Triton 3.9 needs (compile_check fails beyond them).
GEMV_TILES = (GemvTile(128, 128, 8, 128), GemvTile(64, 128, 8, 80), GemvTile(256, 128, 16, 128),
              GemvTile(64, 64, 4, 72), GemvTile(128, 64, 8, 80), GemvTile(64, 32, 2, 72))


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds at once: the launch-independent limits of an architecture."""

    num_sms: int
    max_warps: int          # resident warps per SM
    max_ctas: int           # resident blocks per SM
    shared: int             # shared memory per SM, bytes
    regs: int = 65536       # register file per SM


# (max warps, max blocks, shared memory) per SM by compute capability (CUDA programming guide,
# occupancy table and shared memory capacity).
_ARCH_LIMITS = {86: (48, 16, 100 * 1024), 89: (48, 24, 100 * 1024), 90: (64, 32, 228 * 1024)}
# Shared memory the system keeps for each resident block (compute capability 8.0 and later).
_RESERVED_SHARED = 1024


def sm_limits(num_sms: int, arch: int) -> SmLimits:
    """The limits of `num_sms` SMs of compute capability `arch` (86, 89, 90; others count as 86)."""
    return SmLimits(num_sms, *_ARCH_LIMITS.get(arch, _ARCH_LIMITS[86]))


def resident_programs(regs: int, num_warps: int, sm: SmLimits, shared: int = 0) -> int:
    """How many programs of `num_warps` warps, each thread holding `regs` registers and the block
    `shared` bytes of shared memory, one SM runs at once (registers go out a warp at a time, in
    units of 256)."""
    warp_regs = -(-regs * 32 // 256) * 256
    fit = min(sm.max_warps // num_warps, sm.regs // warp_regs // num_warps, sm.max_ctas)
    return min(fit, sm.shared // (shared + _RESERVED_SHARED)) if shared else fit


def resident_ctas(tile: GemvTile, sm: SmLimits) -> int:
    """How many of `tile`'s programs one SM runs at once (its shared memory is a few hundred bytes and
    never the limit)."""
    return resident_programs(tile.regs, tile.num_warps, sm)


@dataclass(frozen=True)
class GemvGrid:
    """A GEMV launch: its tile, K split in `split_k` equal slices, and the waves its programs make."""

    tile: GemvTile
    split_k: int
    programs: int
    resident: int       # programs per SM
    waves: float        # programs / (SMs x resident)

    def config(self) -> dict[str, int]:
        return {"BLOCK_N": self.tile.block_n, "BLOCK_K": self.tile.block_k, "SPLIT_K": self.split_k,
                "num_warps": self.tile.num_warps}


# Waves within this much of a whole number (≥ 2) leave at most a sliver of the GPU idle at the end.
WAVE_TAIL = 0.15
# Each slice keeps ≥ 2 K-steps so the next step's weights are in flight while one computes.
MIN_STEPS_PER_SLICE = 2
# ≥ 2 programs per SM, so one's start (the norm's 1/rms, the first loads) and end (partials, the
# epilogue) overlap another's streaming.
MIN_RESIDENT = 2


def gemv_grid(n: int, k: int, group_size: int, num_sms: int, resident: dict[GemvTile, int]) -> GemvGrid:
    """The M = 1 launch for an [n, k] weight: pure in its arguments. `resident` maps each tile
    considered to its programs per SM (`resident_ctas`).

    A grid qualifies when its waves are within WAVE_TAIL of a whole number ≥ 2 and an SM holds
    ≥ MIN_RESIDENT of its programs: the SMs stay busy to the end (no 1.4-wave launch whose second
    wave runs 40% of them), and a second wave hides the first one's ramp. Of those, the fewest programs win (each writes split-K partials and
    recomputes the norm in front), then the smallest tail, then the most resident warps. Slices
    are equal (split_k divides the K-steps), so every program of a wave does the same work.
    Shapes too small for two waves (small models) take the grid with the most waves up to 2.
    """
    options = []
    for tile, per_sm in resident.items():
        if group_size % tile.block_k or k % tile.block_k or per_sm < 1:
            continue
        steps = k // tile.block_k
        tiles = -(-n // tile.block_n)
        for split in range(1, steps // MIN_STEPS_PER_SLICE + 1):
            if steps % split:
                continue
            waves = tiles * split / (num_sms * per_sm)
            options.append(GemvGrid(tile, split, tiles * split, per_sm, waves))
    if not options:
        raise ValueError(f"no GEMV tile fits K={k} with group size {group_size}; "
                         f"K and the group size must be multiples of {min(t.block_k for t in GEMV_TILES)}.")

    def tail(g: GemvGrid) -> float:
        return abs(g.waves - round(g.waves))

    good = [g for g in options if round(g.waves) >= 2 and tail(g) <= WAVE_TAIL and g.resident >= MIN_RESIDENT]
    if good:
        return min(good, key=lambda g: (g.programs, tail(g), -g.resident * g.tile.num_warps))
    return min(options, key=lambda g: (-min(g.waves, 2.0), g.programs))


def gemv_grid_for(n: int, k: int, group_size: int, sm: SmLimits) -> GemvGrid:
    """`gemv_grid` over every tile of GEMV_TILES, at the residency `sm` allows."""
    return gemv_grid(n, k, group_size, sm.num_sms, {t: resident_ctas(t, sm) for t in GEMV_TILES})


@functools.lru_cache(maxsize=None)
def device_limits(device: torch.device) -> SmLimits:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        warps, ctas = _ARCH_LIMITS.get(p.major * 10 + p.minor, _ARCH_LIMITS[86])
        return SmLimits(p.multi_processor_count, p.max_threads_per_multi_processor // 32, ctas,
                        getattr(p, "regs_per_multiprocessor", 65536))
    return sm_limits(132, 90)  # an H100/H200; off the GPU it only shapes the interpreter's grid


def _split_for(tiles: int, k_steps: int, num_sms: int) -> int:
    """Split K until there are ~4 programs per SM, keeping ≥ 4 steps per slice and equal slices."""
    want = max(1, min(triton.cdiv(4 * num_sms, tiles), k_steps // 4))
    per = triton.cdiv(k_steps, want)
    return triton.cdiv(k_steps, per)


def default_config(M: int, N: int, K: int, group_size: int = 128,
                   device: torch.device | str = "cpu") -> dict[str, int]:
    """A sensible untuned config for this shape (the keys depend on the kernel M selects)."""
    limits = device_limits(torch.device(device))
    if M == 1:
        return gemv_grid_for(N, K, group_size, limits).config()
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 64 if M <= 16 else 128
    block_k = min(group_size, 128 if M <= 16 else 64)
    # Prefill-sized M has tiles enough, and its partial sums would cost more traffic than they save.
    split = _split_for(triton.cdiv(N, block_n), K // block_k, limits.num_sms) if M <= 16 else 1
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 8 if block_m * block_n >= 8192 else 4, "num_stages": 3}


def candidate_configs(M: int, N: int, K: int, group_size: int = 128,
                      device: torch.device | str = "cpu") -> list[dict[str, int]]:
    """The configs the build's autotuner times for one shape, the default first."""
    out = [default_config(M, N, K, group_size, device)]
    splits = (1, 2, 4, 8, 16)
    if M == 1:
        for tile, split in itertools.product(GEMV_TILES, splits):
            if tile.block_k <= group_size and split <= K // tile.block_k:
                out.append({"BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "SPLIT_K": split,
                            "num_warps": tile.num_warps})
    else:
        # Decode-sized M: one 16-row tile and split K; prefill-sized M: bigger tiles, whole K.
        block_ms = [16] if M <= 16 else [b for b in (32, 64, 128) if b <= max(32, triton.next_power_of_2(M))]
        block_ks = sorted({min(group_size, 64), min(group_size, 128)})
        for block_m, block_n, block_k, warps, split in itertools.product(
                block_ms, (64, 128), block_ks, (4, 8), splits if M <= 16 else (1,)):
            if split <= K // block_k:
                out.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
                            "num_warps": warps, "num_stages": 3})
    unique: dict[tuple, dict[str, int]] = {}
    for c in out:
        unique.setdefault(tuple(sorted(c.items())), c)
    return list(unique.values())


def _resolve_config(M: int, N: int, K: int, group_size: int, device: torch.device,
                    config: dict[str, Any] | None) -> dict[str, int]:
    cfg = default_config(M, N, K, group_size, device)
    if config:
        allowed = _GEMV_KEYS if M == 1 else _MMA_KEYS
        unknown = set(config) - allowed
        if unknown:
            kernel = "GEMV (M = 1)" if M == 1 else "MMA (M >= 2)"
            raise ValueError(f"w4 config keys {sorted(unknown)} do not apply to the {kernel} kernel; "
                             f"allowed: {sorted(allowed)}.")
        cfg.update({k: int(v) for k, v in config.items()})
    bk = cfg["BLOCK_K"]
    if bk < 8 or bk & (bk - 1) or group_size % bk:
        raise ValueError(f"BLOCK_K={bk} must be a power of two that divides the group size {group_size}.")
    if cfg["SPLIT_K"] < 1:
        raise ValueError(f"SPLIT_K must be at least 1; got {cfg['SPLIT_K']}.")
    return cfg


# --- Entry points -------------------------------------------------------------------------------

def w4_linear_triton(x: torch.Tensor, w: W4Weight, config: dict[str, Any] | None = None, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (fp16 or fp32) · Wᵀ + bias -> [..., N] in x's dtype; twin of `w4_linear_ref`.

    Fused around it, each optional: `norm_weight` (x is RMS-normalised first: `rms_norm_ref`),
    `silu_mul` (W is gate_up: returns SiLU(gate)·up [..., N/2]: `silu_mul_ref`), `residual`
    (returns residual + the product, added in x's dtype). `config` overrides the default tile
    config (see `candidate_configs` for its keys).
    """
    K = w.qweight.shape[1] * 8
    N = w.out_features
    G = w.group_size
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the 4-bit weight expects {K}.")
    if K % G:
        raise ValueError(f"K={K} is not a multiple of the group size {G}.")
    if silu_mul and (N % 2 or residual is not None):
        raise ValueError(f"silu_mul needs an even number of gate_up rows ({N}) and no residual.")
    for name in ("qweight", "scales", "zeros"):
        if not getattr(w, name).is_contiguous():
            raise ValueError(f"W4Weight.{name} must be contiguous (row n, then K).")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    n_out = N // 2 if silu_mul else N
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*x.shape[:-1], n_out)
    res = out
    if residual is not None:
        res = residual.reshape(M, n_out)
        if res.stride(-1) != 1:
            res = res.contiguous()
    cfg = _resolve_config(M, N, K, G, x.device, config)
    KW = K // 8
    step = cfg["BLOCK_K"] // 8
    kw_per_split = triton.cdiv(KW // step, cfg["SPLIT_K"]) * step
    split = triton.cdiv(KW, kw_per_split)  # slices actually used once rounded to whole steps
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    has_bias = w.bias is not None
    bias = w.bias if has_bias else w.scales  # any tensor: never read without HAS_BIAS
    nw = norm_weight if norm_weight is not None else w.scales   # never read without NORM
    fused = dict(GROUP=G, HAS_BIAS=has_bias, SPLIT_K=split, NORM=norm_weight is not None,
                 RESIDUAL=residual is not None, GLU=silu_mul, FLOAT_ZERO=w.zeros.dtype.is_floating_point,
                 BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                 num_warps=cfg["num_warps"])

    if M == 1:
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
        _w4_gemv_kernel[grid](
            x2, w.qweight, w.scales, w.zeros, bias, out, part, arrival_counters(x.device, grid[0]), nw, res,
            N, KW, kw_per_split, _NIBBLE_MASK, w.qweight.stride(0), w.scales.stride(0), eps, **fused)
    else:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), split)
        _w4_mma_kernel[grid](
            x2, w.qweight, w.scales, w.zeros, bias, out, part, arrival_counters(x.device, grid[0] * grid[1]), nw,
            res, M, N, KW, kw_per_split, _NIBBLE_MASK,
            x2.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0), res.stride(0), eps,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=cfg["BLOCK_M"],
            num_stages=cfg["num_stages"], **fused)
    return out.reshape(*x.shape[:-1], n_out)


def random_w4(N: int, K: int, group_size: int = 128, bias: bool = False,
              device: torch.device | str = "cpu", seed: int = 0, float_zeros: bool = False) -> W4Weight:
    """A random weight in the runtime layout, for tests, tuning and benchmarks; `float_zeros`: fractional
    fp16 zero points (a GGUF Q4_1 / Q4_K minimum) instead of integer codes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    # ~1/sqrt(K) so that outputs stay O(1) at any K, as trained weights roughly do.
    scales = ((torch.rand(N, K // group_size, generator=g) + 0.5) * (0.5 / math.sqrt(K))).half()
    zeros = torch.randint(0, 16, (N, K // group_size), generator=g, dtype=torch.uint8)
    if float_zeros:
        zeros = (zeros + torch.rand(zeros.shape, generator=g)).half()
    b = torch.randn(N, generator=g).half() if bias else None
    return W4Weight(pack_w4(q).to(device), scales.to(device), zeros.to(device),
                    None if b is None else b.to(device))


def tune_w4(M: int, N: int, K: int, device: torch.device | str, group_size: int = 128) -> dict[str, int]:
    """Time every candidate with `triton.testing.do_bench` and return the fastest config.

    Off CUDA there is nothing to time and the default config comes back. A candidate that does
    not compile or launch on this GPU is skipped (which exception says so varies across Triton
    versions, hence the broad catch).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return default_config(M, N, K, group_size, device)
    w = random_w4(N, K, group_size, device=device)
    x = torch.randn(M, K, dtype=torch.float16, device=device)
    best, best_ms = default_config(M, N, K, group_size, device), math.inf
    for cfg in candidate_configs(M, N, K, group_size, device):
        try:
            ms = triton.testing.do_bench(lambda: w4_linear_triton(x, w, cfg), warmup=10, rep=40,
                                         return_mode="median")
        except Exception:  # noqa: BLE001 - out of shared memory or registers, a ptxas error: skip it
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best
