"""Triton paged mixed-precision attention: flash-decoding for decode, and chunked prefill over the same cache.

Both entry points run one kernel. A program owns one *query tile* (one decoding
sequence, or BLOCK_M consecutive queries of a prefill chunk), one kv head, and one
*partition* of the context; its score tile has a row for every (query, query head)
pair of the tile that reads that kv head, so each K/V byte crosses the memory bus
once per tile however many query heads share it (GQA). A partition walks its slice
of the block table TILE tokens at a time with an online softmax and writes the
unnormalised partial (max, sum, accumulator) to a workspace, and the last partition of
a (query tile, kv head) to arrive (an atomic counter, which it sets back to 0) merges
them into the output: one launch. With one partition the program normalises and
writes the output itself. Splitting the context is what fills the GPU at batch 1.

Every block-table entry carries its block's precision (`kv/pool.py`): e >= 0 is FP16
block e, e < 0 is quantised block -e-1, and the quantised pool's format (INT4 asym
or FP8) is fixed per engine, so it is a compile-time constant here. Two tile loops read the
quantised rows (config `variant`): v1 dequantises them in registers as they are loaded (no
dequantised copy is written to memory); v2 feeds the codes to tl.dot as they are and applies each
group's scale to its product and its zero through the sum of q over the group (`_partition_v2`).

INT4 packs channel 2j in the low nibble and 2j+1 in the high nibble of byte j. The
kernel never re-interleaves: it keeps every head vector as two halves, even and odd
channels, and a score is q_even·k_even + q_odd·k_odd. In FP16 and FP8 caches the
halves are simply the first and second half of the channels, which keeps loads
contiguous. Scores run in the log2 domain (exp2 with log2(e) folded into the scale).

The reference twins are `paged_attention_ref` (prefill, one sequence) and
`paged_decode_attention_ref` (decode, a batch), both in attention_ref.py.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..kv.pool import KVPools
from .arrival import arrival_counters
from .key_offset import KeyOffset
from .attention_ref import (paged_attention_ref, paged_decode_attention_ref,  # noqa: F401 (the twins)
                            paged_tile_attention_ref)

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: without it the runtime uses the reference twins
    triton = None

# How the quantised pool stores rows: the kernels' KV_MODE constexpr (0 no quantised pool, 1 INT4, 2 FP8).
_FP16_ONLY, _INT4, _FP8 = 0, 1, 2
_CONFIG_KEYS = frozenset({"variant", "tile_blocks", "block_m", "num_partitions", "num_warps", "num_stages"})
# The tile loops (`_partition_v1`, `_partition_v2`); v1 is the default, v2 is selectable per config.
VARIANTS = ("v1", "v2")
# Programs per SM the default partition count aims for: a few waves keep the memory
# system busy while some programs wait on their loads.
_PROGRAMS_PER_SM = 4


def available() -> bool:
    """True when the kernels can run: triton imports, and there is a GPU or the interpreter is on."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _jit(*, do_not_specialize: tuple[str, ...] = ()):
    """triton.jit, or without triton the plain, never-called function (with `from __future__ import
    annotations` the `tl.constexpr` annotations stay strings, which triton reads as such).

    Integer arguments that change from step to step (query counts, partitions, table widths) go in
    `do_not_specialize`: Triton would otherwise compile a variant for each kind of value (1, a
    multiple of 16, other) on first sight, during serving, for loop bounds and masks that gain nothing.
    """
    def wrap(fn):
        return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if triton is not None else fn
    return wrap


# --------------------------------------------------------------------------- kernels


@_jit()
def _channel_halves(HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channel indices of the two halves every head vector is kept in."""
    j = tl.arange(0, HEAD_DIM // 2)
    if INTERLEAVED:  # INT4 byte j holds channels 2j and 2j+1: even/odd halves avoid re-interleaving nibbles
        first = 2 * j
        second = 2 * j + 1
    else:
        first = j
        second = j + HEAD_DIM // 2
    return first, second


# The interpreter cannot run PTX: it takes the plain bit-op twin of the inline assembly, as does a
# GPU run with BIE_TRT_INT4_PTX=0 (the device check times both).
_PTX_NIBBLES = (tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1"
                             and os.environ.get("BIE_TRT_INT4_PTX") != "0") if triton is not None else False)


@_jit()
def _nibbles_f16(packed):
    """Low and high nibbles of uint8 bytes as exact fp16 integers 0..15, with no conversion instruction:
    0x6400 | n is the half 1024 + n. Four bytes at a time: PRMT spreads bytes b0, b1 (b2, b3) into
    the two halves of a word, LOP3 ORs the magic exponent onto the low (high) nibbles, and one
    sub.f16x2 (fma.f16x2 for the high nibble, 16n + 1024 -> n) makes the integers; 10 instructions
    for 8 values."""
    if _PTX_NIBBLES:
        lo, hi = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t0, t1, c1024, c16th, cm64;
            mov.b32 c1024, 0x64006400;
            mov.b32 c16th, 0x2C002C00;
            mov.b32 cm64, 0xD400D400;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
            sub.f16x2 $0, $0, c1024;
            sub.f16x2 $1, $1, c1024;
            fma.rn.f16x2 $2, $2, c16th, cm64;
            fma.rn.f16x2 $3, $3, c16th, cm64;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        lo = ((packed & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        hi = ((packed >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@_jit()
def _int4_groups(TILE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT_GROUP: tl.constexpr):
    """INT4 bytes laid out as [group, byte in group]: byte j carries channels 2j and 2j+1, both in group
    j // (QUANT_GROUP // 2), so one scale and zero per group broadcast over the group's bytes."""
    g = tl.arange(0, HEAD_DIM // QUANT_GROUP)
    return g, g[:, None] * (QUANT_GROUP // 2) + tl.arange(0, QUANT_GROUP // 2)[None, :]


@_jit()
def _quant_record(sc_ptr, zr_ptr, sc_off, rows, stride_sc_grp, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr):
    """A tile's quantised rows' record as stored: INT4 scale and zero [TILE, groups, 1]; FP8 the scale [TILE]
    (returned twice). Rows not in `rows` get 0. Nothing is done to the values here: a record read a tile
    ahead must not be touched before the tile that uses it, or the read is waited for at once."""
    if KV_MODE == 1:
        g, byte = _int4_groups(TILE, HEAD_DIM, QUANT_GROUP)
        sc_grp = sc_off[:, None, None] + (g * stride_sc_grp)[None, :, None]
        scale = tl.load(sc_ptr + sc_grp, mask=rows[:, None, None], other=0.0)
        zero = tl.load(zr_ptr + sc_grp, mask=rows[:, None, None], other=0.0)
    else:
        scale = tl.load(sc_ptr + sc_off, mask=rows, other=0.0)
        zero = scale
    return scale, zero


@_jit()
def _quant_codes(qd_ptr, qd_off, rows, ch_a, ch_b, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr):
    """A tile's quantised rows' codes as stored: INT4 the packed bytes [TILE, groups, bytes in group] (returned
    twice); FP8 the two channel halves [TILE, HEAD_DIM // 2]. Rows not in `rows` get code 0."""
    if KV_MODE == 1:
        g, byte = _int4_groups(TILE, HEAD_DIM, QUANT_GROUP)
        a = tl.load(qd_ptr + qd_off[:, None, None] + byte[None, :, :], mask=rows[:, None, None], other=0)
        b = a
    else:
        a = tl.load(qd_ptr + qd_off[:, None] + ch_a[None, :], mask=rows[:, None], other=0.0)
        b = tl.load(qd_ptr + qd_off[:, None] + ch_b[None, :], mask=rows[:, None], other=0.0)
    return a, b


@_jit()
def _dequant_int4(packed, scale, zero, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Even and odd channels [TILE, HEAD_DIM // 2] of INT4 rows: x = q · scale + zero per group of channels."""
    lo, hi = _nibbles_f16(packed)
    if _PTX_NIBBLES or DTYPE != tl.float16:
        even = (lo.to(DTYPE) * scale + zero).to(DTYPE)
        odd = (hi.to(DTYPE) * scale + zero).to(DTYPE)
    else:
        # The interpreter rounds an fp16 a * b + c twice; the GPU fuses it (fma.rn.f16x2), one
        # rounding, which fp32 arithmetic rounded once to fp16 reproduces.
        s32 = scale.to(tl.float32)
        z32 = zero.to(tl.float32)
        even = (lo.to(tl.float32) * s32 + z32).to(DTYPE)
        odd = (hi.to(tl.float32) * s32 + z32).to(DTYPE)
    return tl.reshape(even, (TILE, HEAD_DIM // 2)), tl.reshape(odd, (TILE, HEAD_DIM // 2))


@_jit()
def _dequant(a, b, scale, zero, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr,
             DTYPE: tl.constexpr):
    """A K or V tile's two channel halves [TILE, HEAD_DIM // 2] from its codes (`_quant_codes`) and record
    (`_quant_record`); rows the loads masked are 0 (code 0, record 0), so a tile's FP16 rows can be added as a
    separate product."""
    if KV_MODE == 1:
        x_a, x_b = _dequant_int4(a, scale.to(DTYPE), zero.to(DTYPE), TILE, HEAD_DIM, DTYPE)
    else:
        row_scale = scale.to(tl.float32)[:, None]
        x_a = (a.to(tl.float32) * row_scale).to(DTYPE)
        x_b = (b.to(tl.float32) * row_scale).to(DTYPE)
    return x_a, x_b


@_jit()
def _load_plain_tile(fp_ptr, fp_off, plain, ch_a, ch_b, DTYPE: tl.constexpr):
    """A K or V tile's two channel halves [TILE, HEAD_DIM // 2] from the FP16 pool; rows not in `plain` are 0."""
    a = tl.load(fp_ptr + fp_off[:, None] + ch_a[None, :], mask=plain[:, None], other=0.0).to(DTYPE)
    b = tl.load(fp_ptr + fp_off[:, None] + ch_b[None, :], mask=plain[:, None], other=0.0).to(DTYPE)
    return a, b


@_jit()
def _fp_offsets(entry, plain, slot, kv_head, stride_blk, stride_head, stride_tok):
    """Element offsets of FP16-pool rows (block ids in 64 bits: a large pool's offset can pass 2**31)."""
    blk = tl.where(plain, entry, 0).to(tl.int64)
    return blk * stride_blk + kv_head * stride_head + slot * stride_tok


@_jit()
def _plain_rows(table, kv, live, slot, kv_head, stride_blk, stride_head, stride_tok, BLOCK_SIZE: tl.constexpr):
    """Offsets and mask of a tile's FP16-pool rows, from the block table."""
    entry = tl.load(table + kv // BLOCK_SIZE, mask=live, other=0)
    rows = live & (entry >= 0)
    return _fp_offsets(entry, rows, slot, kv_head, stride_blk, stride_head, stride_tok), rows


@_jit()
def _plain_scores(s, q_a, q_b, k_ptr, table, kv, live, slot, kv_head, stride_blk, stride_head, stride_tok,
                  ch_a, ch_b, BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr):
    """s [ROWS, TILE] plus the scores of a tile's FP16-pool rows (0 for its other rows), a second
    product beside the quantised one (accumulated in place: a separate sum spilled). FP16 rows are rare with a quantised pool: their offsets are built only here,
    from the block table read again (a cache hit), not for every tile in the FP16 load's layout
    (Triton 3.9 hoists the pipelined table read's conversions to the loop top)."""
    off, rows = _plain_rows(table, kv, live, slot, kv_head, stride_blk, stride_head, stride_tok, BLOCK_SIZE)
    f_a, f_b = _load_plain_tile(k_ptr, off, rows, ch_a, ch_b, DTYPE)
    s = tl.dot(q_a, tl.trans(f_a), acc=s, input_precision="ieee")
    return tl.dot(q_b, tl.trans(f_b), acc=s, input_precision="ieee")


@_jit()
def _plain_values(acc_a, acc_b, p, v_ptr, table, kv, live, slot, kv_head, stride_blk, stride_head, stride_tok,
                  ch_a, ch_b, BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr):
    """acc_a, acc_b [ROWS, HEAD_DIM // 2] plus P (in DTYPE) times a tile's FP16-pool V rows."""
    off, rows = _plain_rows(table, kv, live, slot, kv_head, stride_blk, stride_head, stride_tok, BLOCK_SIZE)
    f_a, f_b = _load_plain_tile(v_ptr, off, rows, ch_a, ch_b, DTYPE)
    return tl.dot(p, f_a, acc=acc_a, input_precision="ieee"), tl.dot(p, f_b, acc=acc_b, input_precision="ieee")


@_jit()
def _merge_partitions(m_ws_ptr, l_ws_ptr, acc_ws_ptr, ws_row, row_ok, num_partitions,
                      ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, HEAD_DIM] = Σ_p 2^(m_p - M) acc_p / Σ_p 2^(m_p - M) l_p; empty partitions weigh 0.
    The partials were written by other programs: .cg loads read them from L2, not this SM's L1."""
    m_max = tl.full((ROWS,), float("-inf"), tl.float32)
    for p in range(num_partitions):
        m_max = tl.maximum(m_max, tl.load(m_ws_ptr + ws_row + p, mask=row_ok, other=float("-inf"),
                                          cache_modifier=".cg"))
    # A query that saw no token at all (an empty decode slot) has every max at -inf: 0 keeps
    # the weights at exp2(-inf) = 0 and the output at 0 instead of NaN.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    d = tl.arange(0, HEAD_DIM)
    denom = tl.zeros((ROWS,), tl.float32)
    out = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    for p in range(num_partitions):
        w = tl.exp2(tl.load(m_ws_ptr + ws_row + p, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_ref)
        denom += w * tl.load(l_ws_ptr + ws_row + p, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(acc_ws_ptr + (ws_row + p)[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                      cache_modifier=".cg")
        out += w[:, None] * acc
    return out / tl.where(denom > 0, denom, 1.0)[:, None]


@_jit()
def _tile_positions(t, first_kv, context, TILE: tl.constexpr, SLIDING: tl.constexpr):
    """Tile t's token positions and which are live: below `context` and, in a sliding-window layer, not
    below first_kv (under every row's window, where the blocks may be gone)."""
    kv = t * TILE + tl.arange(0, TILE)
    live = kv < context
    if SLIDING:   # a constexpr: full-attention kernels compile without the bound (registers)
        live = live & (kv >= first_kv)
    return kv, live


@_jit()
def _tile_entries(table, t, first_kv, context, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  SLIDING: tl.constexpr):
    """The block-table entry of each of tile t's positions (0 where the position is not live)."""
    kv, live = _tile_positions(t, first_kv, context, TILE, SLIDING)
    return tl.load(table + kv // BLOCK_SIZE, mask=live, other=0)


@_jit()
def _tile_rows(entry, t, first_kv, context, kv_head, stride_qd_blk, stride_qd_head, stride_qd_tok,
               stride_sc_blk, stride_sc_head, stride_sc_tok, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
               SLIDING: tl.constexpr):
    """Tile t's token positions, which of them are FP16 (`plain`) and quantised (`quant`) rows, and
    the quantised rows' code and record offsets (other rows point at block 0, never read), from the
    tile's block-table entries (`_tile_entries`)."""
    kv, live = _tile_positions(t, first_kv, context, TILE, SLIDING)
    plain = live & (entry >= 0)
    quant = live & (entry < 0)
    slot = kv % BLOCK_SIZE
    # Block ids in 64 bits: a large pool's element offset can pass 2**31.
    q_blk = tl.where(quant, -entry - 1, 0).to(tl.int64)
    qd_off = q_blk * stride_qd_blk + kv_head * stride_qd_head + slot * stride_qd_tok
    sc_off = q_blk * stride_sc_blk + kv_head * stride_sc_head + slot * stride_sc_tok
    has_plain = tl.max(plain.to(tl.int32), 0) > 0
    return kv, live, plain, quant, slot, qd_off, sc_off, has_plain


@_jit()
def _tile_quant(kq_ptr, vq_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, entry, t, first_kv, context, kv_head, ch_a, ch_b,
                stride_qd_blk, stride_qd_head, stride_qd_tok, stride_sc_blk, stride_sc_head, stride_sc_tok,
                stride_sc_grp, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr, SLIDING: tl.constexpr):
    """Everything tile t reads from the quantised pool, from its block-table entries: K's and V's codes
    (`_quant_codes`, two each) and records (`_quant_record`, scale and zero each), as stored."""
    _, _, _, quant, _, qd_off, sc_off, _ = _tile_rows(
        entry, t, first_kv, context, kv_head, stride_qd_blk, stride_qd_head, stride_qd_tok,
        stride_sc_blk, stride_sc_head, stride_sc_tok, BLOCK_SIZE, TILE, SLIDING)
    k_a, k_b = _quant_codes(kq_ptr, qd_off, quant, ch_a, ch_b, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP)
    v_a, v_b = _quant_codes(vq_ptr, qd_off, quant, ch_a, ch_b, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP)
    k_scale, k_zero = _quant_record(ks_ptr, kz_ptr, sc_off, quant, stride_sc_grp, TILE, HEAD_DIM, KV_MODE,
                                    QUANT_GROUP)
    v_scale, v_zero = _quant_record(vs_ptr, vz_ptr, sc_off, quant, stride_sc_grp, TILE, HEAD_DIM, KV_MODE,
                                    QUANT_GROUP)
    return k_a, k_b, v_a, v_b, k_scale, k_zero, v_scale, v_zero


@_jit()
def _softmax_step(s, m_i, l_i, kv, pos, lo, qk_scale, SLIDING: tl.constexpr):
    """Online softmax over one tile of raw scores s [ROWS, TILE] -> (p, alpha, m_i, l_i); a row sees
    positions lo..pos (lo > 0 in a sliding-window layer).

    A row may see nothing in this tile or even this whole partition (an early query of a chunk, a
    padding row): subtracting 0 instead of a -inf max keeps exp2 at a clean 0 rather than NaN."""
    seen = kv[None, :] <= pos[:, None]
    if SLIDING:
        seen = seen & (kv[None, :] >= lo[:, None])
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@_jit()
def _offset_scores(s, off_ptr, inv_ptr, q_off, row_ok, kv, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """s [ROWS, TILE] plus q·R(p)m of each row against the keys at positions kv (centred keys, key_offset.py):
    Σ_i A_i cos(p θ_i) + B_i sin(p θ_i), the rows' coefficients [A | B] read where q's row is in off_ptr (fp32,
    laid out as q; L1-resident after the first tile), cos and sin rounded to the activation dtype as RoPE's are.

    16 pairs a step (tl.dot's smallest K), so the offset adds only [TILE, 16] tiles to the registers the K and V
    tiles already fill. The offset can be most of a key, and what is added back must cancel what the epilogue
    took to about fp32's precision: in fp16/bf16 each coefficient goes in as two parts, its rounding and what
    that rounding left (2^-22 of it in fp16), each a product in the activation dtype accumulated in fp32."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = 16
    p = kv.to(tl.float32)[:, None]
    for j0 in tl.static_range(0, HALF, PAIRS):
        j = j0 + tl.arange(0, PAIRS)
        angle = p * tl.load(inv_ptr + j)[None, :]
        for part in tl.static_range(2):   # the cos and the sin terms
            coef = tl.load(off_ptr + q_off[:, None] + part * HALF + j[None, :], mask=row_ok[:, None], other=0.0)
            turn = tl.trans(tl.cos(angle).to(DTYPE) if part == 0 else tl.sin(angle).to(DTYPE))
            if DTYPE == tl.float32:
                s = tl.dot(coef, turn, acc=s, input_precision="ieee")
            else:
                high = coef.to(DTYPE)
                s = tl.dot(high, turn, acc=s)
                s = tl.dot((coef - high.to(tl.float32)).to(DTYPE), turn, acc=s)
    return s


@_jit()
def _partition_start(q_ptr, q_off, row_ok, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr):
    """A tile loop's channel halves, the rows' q halves and the empty softmax state (m, l, acc_a, acc_b)."""
    ch_a, ch_b = _channel_halves(HEAD_DIM, KV_MODE == 1)
    q_a = tl.load(q_ptr + q_off[:, None] + ch_a[None, :], mask=row_ok[:, None], other=0.0)
    q_b = tl.load(q_ptr + q_off[:, None] + ch_b[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc_a = tl.zeros((ROWS, HEAD_DIM // 2), tl.float32)
    acc_b = tl.zeros((ROWS, HEAD_DIM // 2), tl.float32)
    return ch_a, ch_b, q_a, q_b, m_i, l_i, acc_a, acc_b


@_jit()
def _partition_v1(q_ptr, q_off, row_ok, table, tile_begin, tile_end, context, pos, lo, first_kv, kv_head, qk_scale,
                  k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, off_ptr, inv_ptr,
                  stride_fp_blk, stride_fp_head, stride_fp_tok,
                  stride_qd_blk, stride_qd_head, stride_qd_tok,
                  stride_sc_blk, stride_sc_head, stride_sc_tok, stride_sc_grp,
                  ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr, DTYPE: tl.constexpr, SLIDING: tl.constexpr,
                  CENTRED: tl.constexpr):
    """v1: each tile's quantised K and V are dequantised into [TILE, HEAD_DIM // 2] halves that tl.dot
    takes as they are. Returns the partition's (m, l, acc_a, acc_b) over channel halves a and b."""
    ch_a, ch_b, q_a, q_b, m_i, l_i, acc_a, acc_b = _partition_start(q_ptr, q_off, row_ok, ROWS, HEAD_DIM, KV_MODE)
    # Over a quantised pool what a tile reads (codes and records) is read two tiles ahead and its block-table
    # entries three, at addresses from entries that have already arrived: no load is waited for by the
    # iteration that issues it, and each program keeps two tiles of codes on their way while it computes.
    # Read where they were used, the table and then the records at the addresses it gave were two dependent
    # loads every tile waited for (Triton's pipeliner prefetched the codes but not the 2-byte record
    # gathers, and read the table again in each layout that used it; it does not prefetch loads whose
    # addresses come from a loop-carried entry). The read-ahead stops at the partition's end. An FP16-only
    # pool keeps the pipeliner's prefetch (its tiles, 4x the bytes of INT4 codes, would not fit in
    # registers). `entry` itself only says which of the tile's rows are FP16.
    part_end = tl.minimum(context, tile_end * TILE)
    if KV_MODE != 0:
        entry = _tile_entries(table, tile_begin, first_kv, part_end, BLOCK_SIZE, TILE, SLIDING)
        entry_next = _tile_entries(table, tile_begin + 1, first_kv, part_end, BLOCK_SIZE, TILE, SLIDING)
        entry_far = _tile_entries(table, tile_begin + 2, first_kv, part_end, BLOCK_SIZE, TILE, SLIDING)
        kc_a, kc_b, vc_a, vc_b, k_scale, k_zero, v_scale, v_zero = _tile_quant(
            kq_ptr, vq_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, entry, tile_begin, first_kv, part_end, kv_head,
            ch_a, ch_b, stride_qd_blk, stride_qd_head, stride_qd_tok, stride_sc_blk, stride_sc_head,
            stride_sc_tok, stride_sc_grp, BLOCK_SIZE, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP, SLIDING)
        kn_a, kn_b, vn_a, vn_b, kn_scale, kn_zero, vn_scale, vn_zero = _tile_quant(
            kq_ptr, vq_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, entry_next, tile_begin + 1, first_kv, part_end, kv_head,
            ch_a, ch_b, stride_qd_blk, stride_qd_head, stride_qd_tok, stride_sc_blk, stride_sc_head,
            stride_sc_tok, stride_sc_grp, BLOCK_SIZE, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP, SLIDING)
    for t in range(tile_begin, tile_end):
        if KV_MODE == 0:
            entry = _tile_entries(table, t, first_kv, context, BLOCK_SIZE, TILE, SLIDING)
        kv, live, plain, quant, slot, qd_off, sc_off, has_plain = _tile_rows(
            entry, t, first_kv, context, kv_head, stride_qd_blk, stride_qd_head, stride_qd_tok,
            stride_sc_blk, stride_sc_head, stride_sc_tok, BLOCK_SIZE, TILE, SLIDING)
        if KV_MODE != 0:
            entry_after = _tile_entries(table, t + 3, first_kv, part_end, BLOCK_SIZE, TILE, SLIDING)
            kf_a, kf_b, vf_a, vf_b, kf_scale, kf_zero, vf_scale, vf_zero = _tile_quant(
                kq_ptr, vq_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, entry_far, t + 2, first_kv, part_end, kv_head,
                ch_a, ch_b, stride_qd_blk, stride_qd_head, stride_qd_tok, stride_sc_blk, stride_sc_head,
                stride_sc_tok, stride_sc_grp, BLOCK_SIZE, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP, SLIDING)

        # The quantised body is nearly every tile, so its products stay unconditional; only the few
        # tiles holding sink or window blocks visit the FP16 pool, as a second product: each pool's loads
        # give 0 for the other's rows. (Merging the rows into one tile instead made every tile move its
        # dequantised K/V into the FP16 load's layout.)
        if KV_MODE == 0:
            fp_off = _fp_offsets(entry, plain, slot, kv_head, stride_fp_blk, stride_fp_head, stride_fp_tok)
            k_a, k_b = _load_plain_tile(k_ptr, fp_off, plain, ch_a, ch_b, DTYPE)
        else:
            k_a, k_b = _dequant(kc_a, kc_b, k_scale, k_zero, TILE, HEAD_DIM, KV_MODE, DTYPE)
        s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
        s += tl.dot(q_b, tl.trans(k_b), input_precision="ieee")
        if KV_MODE != 0:
            if has_plain:
                s = _plain_scores(s, q_a, q_b, k_ptr, table, kv, live, slot, kv_head, stride_fp_blk, stride_fp_head,
                                  stride_fp_tok, ch_a, ch_b, BLOCK_SIZE, DTYPE)
        if CENTRED:
            s = _offset_scores(s, off_ptr, inv_ptr, q_off, row_ok, kv, HEAD_DIM, DTYPE)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kv, pos, lo, qk_scale, SLIDING)

        if KV_MODE == 0:
            v_a, v_b = _load_plain_tile(v_ptr, fp_off, plain, ch_a, ch_b, DTYPE)
        else:
            v_a, v_b = _dequant(vc_a, vc_b, v_scale, v_zero, TILE, HEAD_DIM, KV_MODE, DTYPE)
        p = p.to(DTYPE)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, v_a, input_precision="ieee")
        acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b, input_precision="ieee")
        if KV_MODE != 0:
            if has_plain:
                acc_a, acc_b = _plain_values(acc_a, acc_b, p, v_ptr, table, kv, live, slot, kv_head, stride_fp_blk,
                                             stride_fp_head, stride_fp_tok, ch_a, ch_b, BLOCK_SIZE, DTYPE)
            entry, entry_next, entry_far = entry_next, entry_far, entry_after
            kc_a, kc_b, vc_a, vc_b, k_scale, k_zero, v_scale, v_zero = (
                kn_a, kn_b, vn_a, vn_b, kn_scale, kn_zero, vn_scale, vn_zero)
            kn_a, kn_b, vn_a, vn_b, kn_scale, kn_zero, vn_scale, vn_zero = (
                kf_a, kf_b, vf_a, vf_b, kf_scale, kf_zero, vf_scale, vf_zero)
    return m_i, l_i, acc_a, acc_b


# v2 keeps v1's channel halves [rows, HEAD_DIM // 2] and runs one product per group of channels
# over operands whose other groups' columns are 0 (the groups of INT4 byte h are h // (G / 2)), so
# a group's scale multiplies its own product. (Batched [group, rows, channel] products compiled to
# MMA layouts that spread the warps over the groups under Triton 3.6, which spilled 80-13,000 B a
# thread; the masked 2-D products cost NG times the MMA work of one, and MMA is not what a decode
# step waits for.)


@_jit()
def _codes_v2(qd_ptr, qd_off, quant, ch_a, ch_b, HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr,
              DTYPE: tl.constexpr):
    """Both halves' codes [TILE, HEAD_DIM // 2] of a tile's quantised rows as exact DTYPE numbers (INT4:
    the integers 0..15; FP8: e4m3 values, which fp16 holds exactly); other rows are 0."""
    mask = quant[:, None]
    if KV_MODE == 1:
        packed = tl.load(qd_ptr + qd_off[:, None] + tl.arange(0, HEAD_DIM // 2)[None, :], mask=mask, other=0)
        a, b = _nibbles_f16(packed)
    else:
        a = tl.load(qd_ptr + qd_off[:, None] + ch_a[None, :], mask=mask, other=0.0)
        b = tl.load(qd_ptr + qd_off[:, None] + ch_b[None, :], mask=mask, other=0.0)
    return a.to(DTYPE), b.to(DTYPE)


@_jit()
def _record_v2(sc_ptr, sc_off, quant, TILE: tl.constexpr, NG: tl.constexpr, KV_MODE: tl.constexpr):
    """Scale and zero [TILE, NG] fp32 of a tile's quantised rows, 0 for other rows (a masked load: a
    stale NaN record of a slot outside the context never reaches the products). INT4 reads each row's
    (scale, zero) pairs, interleaved in the pack (`kv/pool.py`), as one [TILE, 2 NG] tile; FP8 has a
    scale only (returned twice)."""
    # One return: Triton checks every return statement's type, even in a branch a constexpr rules out.
    if KV_MODE == 1:
        pairs = tl.load(sc_ptr + sc_off[:, None] + tl.arange(0, 2 * NG)[None, :], mask=quant[:, None], other=0.0)
        scale, zero = tl.split(tl.reshape(pairs.to(tl.float32), (TILE, NG, 2)))
    else:
        scale = tl.load(sc_ptr + sc_off, mask=quant, other=0.0).to(tl.float32)[:, None]
        zero = scale
    return scale, zero


@_jit()
def _group_column(x, g, NG: tl.constexpr):
    """Column g of x [rows, NG] as [rows]."""
    if NG == 1:
        col = tl.reshape(x, (x.shape[0],))
    else:
        col = tl.sum(tl.where(tl.arange(0, NG)[None, :] == g, x, 0.0), 1)
    return col


@_jit()
def _only_group(x, grp, g, NG: tl.constexpr):
    """x [rows, HEAD_DIM // 2] with the columns outside group g set to 0 (all of x with one group)."""
    if NG == 1:
        y = x
    else:
        y = tl.where((grp == g)[None, :], x, 0.0)
    return y


@_jit()
def _spread_groups(x, ROWS: tl.constexpr, NG: tl.constexpr, HG: tl.constexpr):
    """[ROWS, NG] -> [ROWS, NG · HG]: each group's value on each of its columns."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (ROWS, NG, HG)), (ROWS, NG * HG))


@_jit()
def _partition_v2(q_ptr, q_off, row_ok, table, tile_begin, tile_end, context, pos, lo, first_kv, kv_head, qk_scale,
                  k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, off_ptr, inv_ptr,
                  stride_fp_blk, stride_fp_head, stride_fp_tok,
                  stride_qd_blk, stride_qd_head, stride_qd_tok,
                  stride_sc_blk, stride_sc_head, stride_sc_tok,
                  ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr, DTYPE: tl.constexpr, SLIDING: tl.constexpr,
                  CENTRED: tl.constexpr):
    """v2 over a quantised pool: no dequantised K/V tile. Per group g of a quantised row,
        score = scale_g · (q_g · codes_g) + zero_g · Σ_{c∈g} q_c          (INT4; FP8: scale · (q · codes))
        acc_g += max(scale_g) · ((P ⊙ scale_g / max(scale_g)) · codes_g) + (P · zero_g) ⊗ 1
    with codes as exact fp16 integers straight into tl.dot; FP16 rows add v1's second product.
    The V loads come first in the iteration, ahead of the K math. Returns v1's (m, l, acc_a, acc_b)."""
    NG: tl.constexpr = HEAD_DIM // QUANT_GROUP if KV_MODE == 1 else 1
    HG: tl.constexpr = HEAD_DIM // (2 * NG)
    ch_a, ch_b, q_a, q_b, m_i, l_i, acc_a, acc_b = _partition_start(q_ptr, q_off, row_ok, ROWS, HEAD_DIM, KV_MODE)
    grp = tl.arange(0, HEAD_DIM // 2) // HG
    # [ROWS, NG]: the sum of q over each group, what the group's zero multiplies
    q_sum = tl.sum(tl.reshape(q_a.to(tl.float32) + q_b.to(tl.float32), (ROWS, NG, HG)), 2)
    for t in range(tile_begin, tile_end):
        entry = _tile_entries(table, t, first_kv, context, BLOCK_SIZE, TILE, SLIDING)
        kv, live, plain, quant, slot, qd_off, sc_off, has_plain = _tile_rows(
            entry, t, first_kv, context, kv_head, stride_qd_blk, stride_qd_head, stride_qd_tok,
            stride_sc_blk, stride_sc_head, stride_sc_tok, BLOCK_SIZE, TILE, SLIDING)
        v_a, v_b = _codes_v2(vq_ptr, qd_off, quant, ch_a, ch_b, HEAD_DIM, KV_MODE, DTYPE)
        v_scale, v_zero = _record_v2(vs_ptr, sc_off, quant, TILE, NG, KV_MODE)
        k_a, k_b = _codes_v2(kq_ptr, qd_off, quant, ch_a, ch_b, HEAD_DIM, KV_MODE, DTYPE)
        k_scale, k_zero = _record_v2(ks_ptr, sc_off, quant, TILE, NG, KV_MODE)

        s = tl.zeros((ROWS, TILE), tl.float32)
        for g in tl.static_range(NG):
            s_g = tl.dot(_only_group(q_a, grp, g, NG), tl.trans(k_a), input_precision="ieee")
            s_g += tl.dot(_only_group(q_b, grp, g, NG), tl.trans(k_b), input_precision="ieee")
            s += s_g * _group_column(k_scale, g, NG)[None, :]
        if KV_MODE == 1:
            s += tl.sum(q_sum[:, None, :] * k_zero[None, :, :], 2)
        if has_plain:
            s = _plain_scores(s, q_a, q_b, k_ptr, table, kv, live, slot, kv_head, stride_fp_blk, stride_fp_head,
                              stride_fp_tok, ch_a, ch_b, BLOCK_SIZE, DTYPE)
        if CENTRED:
            s = _offset_scores(s, off_ptr, inv_ptr, q_off, row_ok, kv, HEAD_DIM, DTYPE)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kv, pos, lo, qk_scale, SLIDING)

        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        for g in tl.static_range(NG):
            # P ⊙ scale is cast to fp16 for the product: scaled by the tile's largest scale first, so
            # it keeps P's own range; p · scale itself (scales ~1e-2) fell into fp16's subnormals and
            # rounded to 0 for the many small p of a long context, a bias, not noise.
            v_scale_g = _group_column(v_scale, g, NG)
            top = tl.max(v_scale_g, 0)
            top = tl.where(top > 0, top, 1.0)
            p_g = (p * (v_scale_g / top)[None, :]).to(DTYPE)
            # the group's columns of a full product: masking the codes instead made a tile to stage
            acc_a += _only_group(tl.dot(p_g, v_a, input_precision="ieee") * top, grp, g, NG)
            acc_b += _only_group(tl.dot(p_g, v_b, input_precision="ieee") * top, grp, g, NG)
        if KV_MODE == 1:
            p_zero = _spread_groups(tl.sum(p[:, :, None] * v_zero[None, :, :], 1), ROWS, NG, HG)
            acc_a += p_zero
            acc_b += p_zero
        if has_plain:
            acc_a, acc_b = _plain_values(acc_a, acc_b, p.to(DTYPE), v_ptr, table, kv, live, slot, kv_head,
                                         stride_fp_blk, stride_fp_head, stride_fp_tok, ch_a, ch_b, BLOCK_SIZE, DTYPE)
    return m_i, l_i, acc_a, acc_b


@_jit(do_not_specialize=("num_queries", "num_partitions", "stride_table"))
def _paged_attention_kernel(
    q_ptr, pos_ptr, table_ptr, tile_ptr,
    k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, off_ptr, inv_ptr,
    m_ws_ptr, l_ws_ptr, acc_ws_ptr, cnt_ptr, out_ptr,
    num_queries, num_partitions, qk_scale, window,
    stride_q_tok, stride_q_head, stride_table, stride_out_tok, stride_out_head,
    stride_fp_blk, stride_fp_head, stride_fp_tok,
    stride_qd_blk, stride_qd_head, stride_qd_tok,
    stride_sc_blk, stride_sc_head, stride_sc_tok, stride_sc_grp,
    NUM_Q_HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr, QUANT_GROUP: tl.constexpr, DTYPE: tl.constexpr,
    LENGTHS: tl.constexpr, V2: tl.constexpr, TILE_MAP: tl.constexpr, SLIDING: tl.constexpr, CENTRED: tl.constexpr,
):
    """pos_ptr: each query's position, or with LENGTHS each decode sequence's length (position + 1).
    V2 picks `_partition_v2` for the tile loop (a quantised pool only), else `_partition_v1`.
    TILE_MAP: query tile i is tile_ptr[i] = (first query, queries <= BLOCK_M, its row of table_ptr), so
    the runs of many sequences (each with its own view of the cache) share one launch; a tile of 0
    queries (a CUDA graph's padding) does nothing. Otherwise tile i is queries i·BLOCK_M.. on table row i.
    CENTRED: the keys are stored centred; off_ptr holds each query row's offset coefficients (laid out as q)
    and inv_ptr the RoPE inverse frequencies, and every score gets q·R(p)m back (key_offset.py)."""
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    if TILE_MAP:
        first = tl.load(tile_ptr + q_tile * 3)
        count = tl.load(tile_ptr + q_tile * 3 + 1)
        table_row = tl.load(tile_ptr + q_tile * 3 + 2).to(tl.int64)
    else:
        first = q_tile * BLOCK_M
        count = BLOCK_M
        table_row = q_tile
    # Row r of the score tile is query r // GROUP_PAD of the tile and query head r % GROUP_PAD of
    # the group; padding rows (tl.dot wants >= 16 rows, and aranges are powers of two) stay masked.
    r = tl.arange(0, ROWS)
    qi = first + r // GROUP_PAD
    q_head = kv_head * GROUP_HEADS + r % GROUP_PAD
    row_ok = (r // GROUP_PAD < count) & (r // GROUP_PAD < BLOCK_M) & (r % GROUP_PAD < GROUP_HEADS) & (qi < num_queries)
    q_off = qi * stride_q_tok + q_head * stride_q_head
    # A query at position p sees cached tokens 0..p; padding rows (and an empty decode slot, p = -1) see none.
    if LENGTHS:
        pos = tl.load(pos_ptr + qi, mask=row_ok, other=0) - 1
    else:
        pos = tl.load(pos_ptr + qi, mask=row_ok, other=-1)
    context = tl.max(pos, 0) + 1
    # A sliding-window layer (window > 0): a row sees positions pos - window + 1 .. pos, and the tiles
    # wholly below every row's window are never read.
    if SLIDING:   # (window > 0; a constexpr so that full-attention kernels carry no bound)
        lo = pos - window + 1
        first_kv = tl.maximum(tl.min(tl.where(row_ok, lo, context), 0), 0)
    else:
        lo = pos
        first_kv = 0
    first_tile = first_kv // TILE

    # This partition's tiles: the tiles from the first one a row sees to the context's end, split into
    # num_partitions runs of whole tiles.
    num_tiles = tl.cdiv(context, TILE)
    tiles_per_part = tl.cdiv(num_tiles - first_tile, num_partitions)
    tile_begin = first_tile + part * tiles_per_part
    tile_end = tl.minimum(tile_begin + tiles_per_part, num_tiles)
    table = table_ptr + table_row * stride_table

    if V2:
        m_i, l_i, acc_a, acc_b = _partition_v2(
            q_ptr, q_off, row_ok, table, tile_begin, tile_end, context, pos, lo, first_kv, kv_head, qk_scale,
            k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, off_ptr, inv_ptr,
            stride_fp_blk, stride_fp_head, stride_fp_tok, stride_qd_blk, stride_qd_head, stride_qd_tok,
            stride_sc_blk, stride_sc_head, stride_sc_tok,
            ROWS, BLOCK_SIZE, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP, DTYPE, SLIDING, CENTRED)
    else:
        m_i, l_i, acc_a, acc_b = _partition_v1(
            q_ptr, q_off, row_ok, table, tile_begin, tile_end, context, pos, lo, first_kv, kv_head, qk_scale,
            k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, off_ptr, inv_ptr,
            stride_fp_blk, stride_fp_head, stride_fp_tok, stride_qd_blk, stride_qd_head, stride_qd_tok,
            stride_sc_blk, stride_sc_head, stride_sc_tok, stride_sc_grp,
            ROWS, BLOCK_SIZE, TILE, HEAD_DIM, KV_MODE, QUANT_GROUP, DTYPE, SLIDING, CENTRED)

    ch_a, ch_b = _channel_halves(HEAD_DIM, KV_MODE == 1)
    out_row = qi * stride_out_tok + q_head * stride_out_head
    if num_partitions == 1:
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_row[:, None] + ch_a[None, :], (acc_a / denom).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(out_ptr + out_row[:, None] + ch_b[None, :], (acc_b / denom).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        # Partials, unnormalised: workspace [query, q_head, partition] (+ channel for the accumulator).
        ws_row = (qi * NUM_Q_HEADS + q_head) * num_partitions
        ws = ws_row + part
        tl.store(m_ws_ptr + ws, m_i, mask=row_ok)
        tl.store(l_ws_ptr + ws, l_i, mask=row_ok)
        tl.store(acc_ws_ptr + ws[:, None] * HEAD_DIM + ch_a[None, :], acc_a, mask=row_ok[:, None])
        tl.store(acc_ws_ptr + ws[:, None] * HEAD_DIM + ch_b[None, :], acc_b, mask=row_ok[:, None])
        tl.debug_barrier()   # every thread's partials are out before the arrival is counted
        counter = cnt_ptr + q_tile * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_partitions - 1:
            out = _merge_partitions(m_ws_ptr, l_ws_ptr, acc_ws_ptr, ws_row, row_ok, num_partitions, ROWS, HEAD_DIM)
            d = tl.arange(0, HEAD_DIM)
            tl.store(out_ptr + out_row[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(counter, 0)


# --------------------------------------------------------------------------- host side


def _kv_mode(pools: KVPools) -> int:
    if pools.k_q is None:
        return _FP16_ONLY
    return _INT4 if pools.cfg.dtype == "int4_asym" else _FP8


def _tl_dtype(dtype: torch.dtype) -> Any:
    table = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    if dtype not in table:
        raise TypeError(f"paged attention takes fp16, bf16 or fp32 queries, not {dtype}.")
    return table[dtype]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 0 off the GPU (the interpreter runs programs one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def default_num_partitions(programs_per_partition: int, max_tiles: int, sms: int) -> int:
    """Partitions per context when none are given: a few programs per SM, at most one per KV tile;
    one off the GPU (sms = 0), where splitting only adds work.

    Depends on shapes only (never on the lengths, which live on the GPU), so it is fixed for a
    captured CUDA graph.
    """
    if sms == 0:
        return 1
    wanted = -(-_PROGRAMS_PER_SM * sms // programs_per_partition)
    return max(1, min(wanted, max_tiles))


def default_config(on_gpu: bool, group_pad: int, quantised: bool = False, prefill: bool = False,
                   variant: str = "v1") -> dict:
    """Tile sizes when the caller gives none (`quantised`: the cache has a quantised pool; `prefill`: a
    chunk or verify launch, several queries a tile). On the GPU a step reads 4 blocks of KV, and a
    prefill program holds about 64 score rows (a few queries times the heads of a group).

    v1's decode over a quantised pool holds the next two tiles' codes and records beside the current
    tile's dequantised K/V: at 4 blocks a step and 4 warps that spilled (Llama-3-8B shapes, Triton 3.9:
    132-144 B a thread on sm_90; with 8 warps it fits, one program an SM, as many bytes on their way as
    the default's two); at 2 blocks and 4 warps it spills nothing on sm_86, sm_89 or sm_90
    under 3.9 (about 200 registers: two programs an SM, four tiles of codes on their way) and 4-12 B
    under 3.6, whose ptxas holds it to 168 registers (three programs an SM). One tile ahead at 4 blocks
    and 8 warps was one program an SM with one tile on its way.

    A prefill over a quantised cache reads 2 blocks a step: with 4, its dequantised K/V on top of the
    64-row tile spilled registers (`scripts/compile_check.py`, INT4: 240 B a thread on sm_90 and 972 B
    on sm_86 under Triton 3.9, 516 B on sm_86 under 3.6). v2's quantised prefill holds one product per
    group: it reads 1 block a step for about 32 rows with 8 warps (2 blocks and 64 rows with 8 warps
    spilled 204 B on sm_86, 184 B on sm_90, 3.9). The interpreter gets small tiles."""
    if not on_gpu:
        return {"variant": variant, "tile_blocks": 2, "block_m": max(1, 16 // group_pad), "num_warps": 4}
    if quantised and prefill and variant == "v2":
        return {"variant": variant, "tile_blocks": 1, "block_m": max(1, 32 // group_pad), "num_warps": 8}
    if quantised and prefill:
        # 32 score rows, not 64: on an H200 under Triton 3.6, v1's INT4 prefill over 64 rows (Llama-3-8B
        # heads, 512 queries) returned wrong outputs (max |Δ| 3.9 against the reference) and crashed with
        # an illegal address at 1 block a step or 8 warps, where 32 rows matched (5e-3).
        return {"variant": variant, "tile_blocks": 2, "block_m": max(1, 32 // group_pad), "num_warps": 4}
    if quantised and variant == "v1":
        return {"variant": variant, "tile_blocks": 2, "block_m": max(1, 64 // group_pad), "num_warps": 4}
    return {"variant": variant, "tile_blocks": 4, "block_m": max(1, 64 // group_pad), "num_warps": 4}


def _resolve_config(config: dict | None, device: torch.device, group_pad: int, quantised: bool,
                    prefill: bool) -> dict:
    cfg = dict(config or {})
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown paged-attention config keys {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}.")
    variant = cfg.get("variant", "v1")
    if variant not in VARIANTS:
        raise ValueError(f"unknown paged-attention variant {variant!r}; use one of {', '.join(VARIANTS)}.")
    return {**default_config(device.type == "cuda", group_pad, quantised, prefill, variant), **cfg}


def _check_inputs(q: torch.Tensor, pools: KVPools, table: torch.Tensor) -> None:
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, pool_dim = pools.k.shape[2], pools.k.shape[4]
    if head_dim != pool_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q [*, {num_q_heads}, {head_dim}] does not fit a cache of {num_kv_heads} kv heads "
                         f"of dim {pool_dim}.")
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention needs a power-of-two head_dim >= 32, not {head_dim}.")
    if pools.cfg.dtype == "int4_asym" and pools.k_q is not None and head_dim % pools.cfg.group_size:
        raise ValueError(f"INT4 group size {pools.cfg.group_size} does not divide head_dim {head_dim}.")
    if table.dtype != torch.int32:
        raise TypeError(f"block tables must be int32, not {table.dtype}.")
    if q.stride(-1) != 1 or pools.k.stride(-1) != 1:
        raise ValueError("q and the KV pools need a contiguous last (channel) dimension.")


def _paged_attention(q: torch.Tensor, pools: KVPools, layer: int, table: torch.Tensor, stride_table: int,
                     table_width: int, positions: torch.Tensor, lengths: bool, scale: float, block_m: int,
                     num_partitions: int | None, cfg: dict, out: torch.Tensor | None = None,
                     tiles: torch.Tensor | None = None, window: int = 0,
                     offset: KeyOffset | None = None) -> torch.Tensor:
    """One launch over (query tiles, kv heads, partitions); `positions` holds lengths when `lengths`;
    `tiles` int32 [N, 3] lays the query tiles out (the kernel's TILE_MAP), else BLOCK_M queries each;
    `window` > 0: each query sees only the last `window` positions up to its own; `offset`: centred keys'
    scores get q·R(p)m back (key_offset.py)."""
    num_queries, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = pools.k.shape[2], pools.k.shape[3]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = max(16, block_m * group_pad)  # tl.dot wants at least 16 rows
    tile = cfg["tile_blocks"] * block_size
    num_q_tiles = triton.cdiv(num_queries, block_m) if tiles is None else tiles.shape[0]
    max_tiles = triton.cdiv(table_width * block_size, tile)
    parts = num_partitions or cfg.get("num_partitions") or default_num_partitions(num_q_tiles * num_kv_heads,
                                                                                 max_tiles, sm_count(q.device))
    mode = _kv_mode(pools)

    k, v = pools.k[layer], pools.v[layer]
    if mode == _FP16_ONLY:  # no quantised pool: the pointers are never dereferenced
        kq = vq = ks = vs = kz = vz = k
    else:
        kq, vq, ks, vs = pools.k_q[layer], pools.v_q[layer], pools.k_scale[layer], pools.v_scale[layer]
        kz = pools.k_zero[layer] if mode == _INT4 else ks  # FP8 has no zero point
        vz = pools.v_zero[layer] if mode == _INT4 else vs

    ws = parts if parts > 1 else 0   # one partition writes its output directly
    m_ws = torch.empty((num_queries, num_q_heads, ws), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((num_queries, num_q_heads, ws, head_dim), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"attention output {tuple(out.shape)} must have q's shape {tuple(q.shape)}, channels contiguous.")
    if offset is not None:
        coefficients = offset.coefficients
        if coefficients.shape != q.shape or coefficients.stride() != q.stride() or coefficients.dtype != torch.float32:
            raise ValueError(f"key offset coefficients {tuple(coefficients.shape)} must be fp32 laid out as q "
                             f"{tuple(q.shape)}.")
        off, inv = coefficients, offset.inv_freq.to(device=q.device, dtype=torch.float32)
    else:   # never dereferenced without CENTRED
        off = inv = q
    launch = {key: cfg[key] for key in ("num_warps", "num_stages") if key in cfg}
    _paged_attention_kernel[(num_q_tiles, num_kv_heads, parts)](
        q, positions, table, table if tiles is None else tiles,
        k, v, kq, vq, ks, vs, kz, vz, off, inv,
        m_ws, l_ws, acc_ws, arrival_counters(q.device, num_q_tiles * num_kv_heads), out,
        num_queries, parts, scale * math.log2(math.e), window,
        q.stride(0), q.stride(1), stride_table, out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        kq.stride(0), kq.stride(1), kq.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), ks.stride(-1),
        NUM_Q_HEADS=num_q_heads, GROUP_HEADS=group, GROUP_PAD=group_pad, BLOCK_M=block_m, ROWS=rows,
        BLOCK_SIZE=block_size, TILE=tile, HEAD_DIM=head_dim, KV_MODE=mode,
        QUANT_GROUP=pools.cfg.group_size if mode == _INT4 else 1, DTYPE=_tl_dtype(q.dtype), LENGTHS=lengths,
        V2=cfg["variant"] == "v2" and mode != _FP16_ONLY, TILE_MAP=tiles is not None, SLIDING=window > 0,
        CENTRED=offset is not None, **launch,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_partitions: int | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    offset: KeyOffset | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [S, H_q, D], attending all context_lens[s] cached tokens -> [S, H_q, D].

    block_tables int32 [S, max_blocks] of signed entries (anything past a sequence's length is
    ignored); the current token's K/V must already be in the cache. A sequence of length 0 (a
    padding slot) gets zeros. `num_partitions` splits each context (default: enough programs to
    fill the GPU); `config` takes variant ("v1" or "v2"), tile_blocks, num_warps, num_stages; the result
    goes to `out` when given.
    """
    _check_inputs(q, pools, block_tables)
    cfg = _resolve_config(config, q.device, triton.next_power_of_2(q.shape[1] // pools.k.shape[2]),
                          quantised=_kv_mode(pools) != _FP16_ONLY, prefill=False)
    # the kernel reads lengths: each query sits at its sequence's last position
    context_lens = context_lens.to(device=q.device, dtype=torch.int32)   # no copy when it already is
    return _paged_attention(q, pools, layer, block_tables, block_tables.stride(0), block_tables.shape[1],
                            context_lens, True, scale, 1, num_partitions, cfg, out, window=window, offset=offset)


def paged_prefill_attention(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    config: dict | None = None,
    window: int = 0,
    offset: KeyOffset | None = None,
) -> torch.Tensor:
    """Chunk attention of one sequence, q [T, H_q, D]: query t sees cached tokens j <= positions[t] -> [T, H_q, D].

    Same semantics as `paged_attention_ref`: the chunk's K/V are already written into the
    cache (FP16 tail) and block_table int32 [max_blocks] covers positions.max(). Also the
    verification pass of speculative decoding (a few queries). `config` takes variant, block_m,
    tile_blocks, num_partitions, num_warps, num_stages.
    """
    _check_inputs(q, pools, block_table)
    cfg = _resolve_config(config, q.device, triton.next_power_of_2(q.shape[1] // pools.k.shape[2]),
                          quantised=_kv_mode(pools) != _FP16_ONLY, prefill=True)
    pos = positions.to(device=q.device, dtype=torch.int32)
    return _paged_attention(q, pools, layer, block_table, 0, block_table.shape[0], pos, False, scale,
                            cfg["block_m"], None, cfg, window=window, offset=offset)


def paged_tile_attention(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    tiles: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    block_m: int,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    offset: KeyOffset | None = None,
) -> torch.Tensor:
    """Attention of every row of a step in one launch, q [T, H_q, D]: query tile i holds rows
    tiles[i, 0] .. + tiles[i, 1] (at most `block_m`), which read the cache through tables[tiles[i, 2]];
    a row at positions[t] sees cached tokens j <= positions[t]. Each sequence's run of rows (a
    speculative verify, cut where the window's quantised end moves, a decode row beside it) is one or
    more tiles over its own table, so each row reads the blocks plain decoding reads at its position.

    tiles, tables, positions int32 on q's device; rows of no tile are left as they are in `out`
    (uninitialised when it is not given). The twin is `paged_tile_attention_ref`.
    """
    _check_inputs(q, pools, tables)
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 3:
        raise TypeError(f"tiles must be int32 [N, 3] (first row, rows, table row), not {tiles.dtype} {tuple(tiles.shape)}.")
    cfg = _resolve_config(config, q.device, triton.next_power_of_2(q.shape[1] // pools.k.shape[2]),
                          quantised=_kv_mode(pools) != _FP16_ONLY, prefill=True)
    pos = positions.to(device=q.device, dtype=torch.int32)   # no copy when it already is
    return _paged_attention(q, pools, layer, tables, tables.stride(0), tables.shape[1], pos, False, scale,
                            block_m, None, cfg, out, tiles, window, offset)
