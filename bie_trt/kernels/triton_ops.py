"""Triton twins of the small per-token ops and the KV-cache writers.

Reference twins: `rms_norm_ref`, `silu_mul_ref`, `write_kv_ref` (reference.py) and
`bie_trt.kv.quant.quantize_block`. The block quantiser is byte-identical to its twin: it follows
the same fp32 operation order, uses IEEE division (`div_rn`, where Triton's `/` is approximate
on NVIDIA GPUs) and rounds codes half-to-even. FP8 codes are made with integer bit operations
rather than a cast, because the cast's rounding differs between the Triton interpreter and the
GPU; the bit recipe is the one torch uses, so every backend writes the same bytes.

Importing this module needs triton; `available()` says whether the kernels can run.
"""
from __future__ import annotations

import os
import torch
import triton
import triton.language as tl

from ..kv.pool import KVPools
from .reference import QKNorm

# The smallest normal fp16 (2^-14): quant.py's floor for scales. Globals a kernel reads must be constexpr.
_MIN_SCALE = tl.constexpr(6.103515625e-05)
_FP8_MAX = tl.constexpr(448.0)


def available() -> bool:
    """True when the kernels can run: a CUDA GPU, or the Triton CPU interpreter (tests)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [rows, D] with a unit stride along D."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# --- RMSNorm with the residual add fused in front ------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
                     stride_x, stride_r, stride_o, stride_s, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0)
    if HAS_RESIDUAL:
        # Added in the activation dtype, as the reference does, so the residual stream matches it.
        x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual the second item is x itself."""
    D = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else x2
    r2 = _rows(residual) if residual is not None else x2
    block = triton.next_power_of_2(D)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, summed,
        x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0), D, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=warps)
    return out.view(x.shape), (summed.view(x.shape) if residual is not None else x)


# --- SiLU(gate) * up ----------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = torch.empty((gu.shape[0], I), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I, block))](
        gu, out, I, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], I)


# --- K/V scatter into the FP16 pool -------------------------------------------------------------

@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, blocks_ptr, offsets_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_cs, H, D,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: token t's K and V, all heads, into slot offsets[t] of FP16 block blocks[t]."""
    t = tl.program_id(0)
    block = tl.load(blocks_ptr + t)
    slot = tl.load(offsets_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < H) & (offs_d < D)
    dst = block * stride_cb + offs_h * stride_ch + slot * stride_cs + offs_d
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(pools: KVPools, layer: int, k: torch.Tensor, v: torch.Tensor,
                    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Store k, v [T, H_kv, D]: token t to FP16 block slot_blocks[t], offset slot_offsets[t]; twin of `write_kv_ref`."""
    T, H, D = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kc, vc = pools.k[layer], pools.v[layer]  # [N_fp, H, B, D]; the same strides for k and v
    _write_kv_kernel[(T,)](
        k, v, kc, vc, slot_blocks, slot_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), H, D,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D), num_warps=4)


# --- The qkv epilogue: RoPE, key centering and scale, Hadamard rotation, K/V into the FP16 tail --

@triton.jit
def _halves(x, D: tl.constexpr):
    """x [D] -> its first and second half [D/2] (register renumbering only)."""
    return tl.split(tl.permute(tl.reshape(x, (2, D // 2)), (1, 0)))


@triton.jit
def _hadamard(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """x [D] fp32 -> x @ H, the normalised Sylvester Walsh–Hadamard matrix (`kv.rotation`), in registers.

    H_D is the D-fold tensor power of H_2, so one butterfly on the leading index bit followed by a
    rotation of the bits, repeated log2(D) times, applies it; each stage is the same reshape."""
    for _ in tl.static_range(LOG2_D):
        a, b = _halves(x, D)
        x = tl.reshape(tl.join(a + b, a - b), (D,))
    return x * tl.rsqrt(tl.zeros_like(x) + D)


@triton.jit
def _rope(x, cos, sin, D: tl.constexpr, DTYPE: tl.constexpr):
    """Rotate-half RoPE of x [D] in fp32 with cos/sin [D/2] (the same for both halves); each product
    and the sum rounded to the activation dtype, as the torch twin computes them."""
    x1, x2 = _halves(x, D)
    r1 = ((x1 * cos).to(DTYPE).to(tl.float32) + (-x2 * sin).to(DTYPE).to(tl.float32)).to(DTYPE)
    r2 = ((x2 * cos).to(DTYPE).to(tl.float32) + (x1 * sin).to(DTYPE).to(tl.float32)).to(DTYPE)
    return tl.reshape(tl.permute(tl.join(r1, r2), (1, 0)), (D,)).to(tl.float32)


@triton.jit
def _head_norm(x, w_ptr, eps, D: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of one head x [D] fp32 over its D channels, times weight [D], rounded to the activation dtype
    as `rms_norm_ref` hands it on (to RoPE)."""
    d = tl.arange(0, D)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    return (x * rstd * tl.load(w_ptr + d).to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _qkv_epilogue_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, mean_ptr, scale_ptr, qn_ptr, kn_ptr, q_out_ptr, off_out_ptr,
                         kc_ptr, vc_ptr, blocks_ptr, offsets_ptr, eps,
                         stride_qkv, stride_qo, stride_cb, stride_ch, stride_cs,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
                         CENTRE: tl.constexpr, SCALE_K: tl.constexpr, ROTATE_K: tl.constexpr, ROTATE_V: tl.constexpr,
                         QK_NORM: tl.constexpr):
    """One program per (token, head): a query head, or a kv head's K and V. A program holds its whole
    head, so Qwen3's per-head q/k norm costs no extra pass (and nothing when QK_NORM is off)."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    DTYPE = q_out_ptr.dtype.element_ty
    d = tl.arange(0, D)
    j = tl.arange(0, D // 2)
    # cos/sin in fp32, then rounded to the activation dtype (Rope.cos_sin)
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j)
    cos = tl.cos(freq).to(DTYPE).to(tl.float32)
    sin = tl.sin(freq).to(DTYPE).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    if head < NUM_HEADS:
        q = tl.load(row + head * D + d).to(tl.float32)
        if QK_NORM:
            q = _head_norm(q, qn_ptr, eps, D, DTYPE)
        q = _rope(q, cos, sin, D, DTYPE)
        if CENTRE:   # q's offset coefficients [A | B] against its KV head's pre-RoPE mean (key_offset.py)
            m1, m2 = _halves(tl.load(mean_ptr + (head // (NUM_HEADS // NUM_KV_HEADS)) * D + d).to(tl.float32), D)
            q1, q2 = _halves(q, D)
            off = tl.reshape(tl.permute(tl.join(q1 * m1 + q2 * m2, q2 * m1 - q1 * m2), (1, 0)), (D,))
            tl.store(off_out_ptr + t * stride_qo + head * D + d, off)
        if SCALE_K:   # times its KV head's key scale: q·k is unchanged by keys stored divided by it
            s = tl.load(scale_ptr + (head // (NUM_HEADS // NUM_KV_HEADS)) * D + d).to(tl.float32)
            q = (q * s).to(DTYPE).to(tl.float32)
        if ROTATE_K:
            q = _hadamard(q, D, LOG2_D)
        tl.store(q_out_ptr + t * stride_qo + head * D + d, q.to(DTYPE))
    else:
        kv_head = head - NUM_HEADS
        k = tl.load(row + (NUM_HEADS + kv_head) * D + d).to(tl.float32)
        if QK_NORM:
            k = _head_norm(k, kn_ptr, eps, D, DTYPE)
        if CENTRE:   # before RoPE: the cache holds R(p)(k - m)
            k = (k - tl.load(mean_ptr + kv_head * D + d).to(tl.float32)).to(DTYPE).to(tl.float32)
        k = _rope(k, cos, sin, D, DTYPE)
        if SCALE_K:
            k = (k / tl.load(scale_ptr + kv_head * D + d).to(tl.float32)).to(DTYPE).to(tl.float32)
        if ROTATE_K:
            k = _hadamard(k, D, LOG2_D)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * D + d).to(tl.float32)
        if ROTATE_V:
            v = _hadamard(v, D, LOG2_D)
        # K/V are rounded to the activation dtype first, as the unfused path hands them over
        dst = tl.load(blocks_ptr + t).to(tl.int64) * stride_cb + kv_head * stride_ch + tl.load(offsets_ptr + t) * stride_cs + d
        tl.store(kc_ptr + dst, k.to(DTYPE).to(kc_ptr.dtype.element_ty))
        tl.store(vc_ptr + dst, v.to(DTYPE).to(vc_ptr.dtype.element_ty))


def qkv_epilogue_triton(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                        inv_freq: torch.Tensor, key_mean: torch.Tensor | None, rotate_keys: bool, rotate_values: bool,
                        pools: KVPools, layer: int, slot_blocks: torch.Tensor,
                        slot_offsets: torch.Tensor, qk_norm: QKNorm | None = None,
                        key_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch for everything between the qkv projection and attention; twin of `qkv_epilogue_ref`."""
    T = qkv.shape[0]
    D = pools.k.shape[-1]
    if D & (D - 1):
        raise ValueError(f"the fused qkv epilogue needs a power-of-two head_dim; got {D}.")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    offset = torch.empty((T, num_heads, D), dtype=torch.float32, device=qkv.device) if key_mean is not None else None
    if T == 0:
        return q, offset
    kc, vc = pools.k[layer], pools.v[layer]
    mean = key_mean if key_mean is not None else inv_freq   # never read without CENTRE
    scale = key_scale if key_scale is not None else inv_freq   # never read without SCALE_K
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (None, None, 0.0)   # no pointers: nothing to read
    _qkv_epilogue_kernel[(T, num_heads + num_kv_heads)](
        qkv, positions, inv_freq, mean, scale, q_norm, k_norm, q, offset if offset is not None else q, kc, vc,
        slot_blocks, slot_offsets, eps,
        qkv.stride(0), q.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=D, LOG2_D=D.bit_length() - 1, CENTRE=key_mean is not None,
        SCALE_K=key_scale is not None, ROTATE_K=rotate_keys, ROTATE_V=rotate_values, QK_NORM=qk_norm is not None,
        num_warps=1 if D <= 64 else 2)
    return q, offset


# --- The fused block quantiser ------------------------------------------------------------------

@triton.jit
def _round_half_even(v):
    """Round to the nearest integer, ties to even: torch.round's rule."""
    f = tl.floor(v)
    d = v - f
    odd = (f.to(tl.int32) & 1) == 1
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _fp16_at_or_below(lo):
    """fp32 -> the fp16 nearest to lo that is not above it (quant.py's zero: nearest, then nextafter down)."""
    z = lo.to(tl.float16)
    bits = z.to(tl.int16, bitcast=True)
    # One fp16 step towards -inf: positive values lose one from their bit pattern, negative ones
    # (including -0) gain one, and +0 goes to the smallest negative subnormal (0x8001).
    down = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1)).to(tl.int16)
    return tl.where(z.to(tl.float32) > lo, down.to(tl.float16, bitcast=True), z)


@triton.jit
def _quant_int4_head(src, dst_q, dst_s, dst_z, stride_st, stride_sg,
                     BLOCK_SIZE: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
    """One head's [B, D] tile -> packed codes [B, D/2], scale and zero [B, D/G] (quantize_int4_asym);
    scale and zero are strided (token, group): the pool interleaves them in one record."""
    NG: tl.constexpr = D // GROUP
    HALF: tl.constexpr = GROUP // 2
    # [token, group, channel pair]: channel 2c of a pair is the low nibble, 2c + 1 the high one.
    t = tl.arange(0, BLOCK_SIZE)[:, None, None]
    g = tl.arange(0, NG)[None, :, None]
    c = tl.arange(0, HALF)[None, None, :]
    even = src + t * D + g * GROUP + 2 * c
    x_lo = tl.load(even).to(tl.float32)
    x_hi = tl.load(even + 1).to(tl.float32)
    lo = tl.minimum(tl.min(x_lo, axis=2), tl.min(x_hi, axis=2))
    hi = tl.maximum(tl.max(x_lo, axis=2), tl.max(x_hi, axis=2))
    zero = _fp16_at_or_below(lo)
    zf = zero.to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(hi - zf, 15.0), _MIN_SCALE).to(tl.float16)
    sf = scale.to(tl.float32)[:, :, None]
    zf = zf[:, :, None]
    q_lo = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x_lo - zf, sf)), 0.0), 15.0)
    q_hi = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x_hi - zf, sf)), 0.0), 15.0)
    packed = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)
    tl.store(dst_q + t * (D // 2) + g * HALF + c, packed.to(tl.uint8))
    ts = tl.arange(0, BLOCK_SIZE)[:, None] * stride_st + tl.arange(0, NG)[None, :] * stride_sg
    tl.store(dst_s + ts, scale)
    tl.store(dst_z + ts, zero)


@triton.jit
def _e4m3_bits(v):
    """fp32 in [-448, 448] -> float8_e4m3fn bit pattern, round-half-even (torch's c10 recipe)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|v| >= 2^-6): rebias the exponent (127 -> 7) and round the mantissa to
    # 3 bits by adding just under half an ulp plus the kept mantissa's lowest bit.
    normal = (mag + ((7 - 127) << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # Subnormals are the multiples of 2^-9; 8 · 2^-9 is the smallest normal, code 0x08, so the
    # rounded count is the code either way.
    sub = _round_half_even(mag.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    return (tl.where(mag >= (121 << 23), normal, sub) | sign).to(tl.uint8)


@triton.jit
def _quant_fp8_head(src, dst_q, dst_s, stride_st, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """One head's [B, D] tile -> e4m3 bytes [B, D] and one scale per token (quantize_fp8)."""
    offs = tl.arange(0, BLOCK_SIZE)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(src + offs).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _MIN_SCALE).to(tl.float16)
    v = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    tl.store(dst_q + offs, _e4m3_bits(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)))
    tl.store(dst_s + tl.arange(0, BLOCK_SIZE) * stride_st, scale)


@triton.jit
def _quantize_block_kernel(k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr,
                           stride_l, stride_h, stride_ql, stride_qh, stride_sl, stride_sh, stride_st, stride_sg,
                           IS_INT4: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                           GROUP: tl.constexpr):
    """One program per (layer, head), K then V: a whole block leaves the window in one launch."""
    # In 64 bits: layer * stride_ql passes 2**31 in a big quantised pool (an 8B at 16 x 128k: 31 * 2**30).
    layer = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    src = layer * stride_l + head * stride_h
    q = layer * stride_ql + head * stride_qh
    s = layer * stride_sl + head * stride_sh
    if IS_INT4:
        _quant_int4_head(k_ptr + src, kq_ptr + q, ks_ptr + s, kz_ptr + s, stride_st, stride_sg, BLOCK_SIZE, D, GROUP)
        _quant_int4_head(v_ptr + src, vq_ptr + q, vs_ptr + s, vz_ptr + s, stride_st, stride_sg, BLOCK_SIZE, D, GROUP)
    else:
        _quant_fp8_head(k_ptr + src, kq_ptr + q, ks_ptr + s, stride_st, BLOCK_SIZE, D)
        _quant_fp8_head(v_ptr + src, vq_ptr + q, vs_ptr + s, stride_st, BLOCK_SIZE, D)


def quantize_block_triton(pools: KVPools, fp_block: int, q_block: int) -> None:
    """FP16 block `fp_block` -> quantised block `q_block`, every layer, K and V, in one launch.

    Twin of `quantize_block(pools, None, fp_block, q_block)`, byte for byte.
    """
    if pools.k_q is None:
        raise ValueError(f"the KV cache ({pools.cfg.dtype}) has no quantised pool to quantise into.")
    if pools.cfg.dtype == "int4_asym" and pools.cfg.scale_scope != "group":
        raise ValueError(f"the Triton block quantiser keeps one range per group of one token and head; the "
                         f"{pools.cfg.scale_scope!r} scale scope is an evaluation ablation: use quantize_block.")
    L, _, H, B, D = pools.k.shape
    is_int4 = pools.cfg.dtype == "int4_asym"
    group = pools.cfg.group_size if is_int4 else D
    if D & (D - 1) or group & (group - 1) or D % group:
        raise ValueError(f"the Triton block quantiser needs a power-of-two head_dim and group; got {D} and {group}.")
    src_k, src_v = pools.k[:, fp_block], pools.v[:, fp_block]  # [L, H, B, D], contiguous inside a head
    kq, vq = pools.k_q[:, q_block], pools.v_q[:, q_block]
    if not is_int4:
        # Written as raw bytes: see the module docstring.
        kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
    ks, vs = pools.k_scale[:, q_block], pools.v_scale[:, q_block]
    kz = pools.k_zero[:, q_block] if is_int4 else ks  # fp8 has no zero; never written
    vz = pools.v_zero[:, q_block] if is_int4 else vs
    _quantize_block_kernel[(L, H)](
        src_k, src_v, kq, vq, ks, vs, kz, vz,
        src_k.stride(0), src_k.stride(1), kq.stride(0), kq.stride(1), ks.stride(0), ks.stride(1), ks.stride(2),
        ks.stride(3),
        IS_INT4=is_int4, BLOCK_SIZE=B, D=D, GROUP=group, num_warps=4)
