"""GGUF block-quantised linear weights kept as the file stores them, and their plain-torch dequantisers.

A GGUF tensor [N, K] is N rows of K/B blocks of B weights each (B = 32, or 256 for the K-quants), a block
being a fixed number of bytes. The engine keeps those bytes untouched (uint8 [N, row bytes]) with the
format's name, so a linear computes with exactly the file's weights; the Triton kernels
(`triton_gguf.py`) dequantise a block in their inner loop and these functions are their twins.

Each dequantiser is written from the format's definition in ggml (`ggml-quants.c`, `dequantize_row_*`),
in its order of float operations (`(d·sc)·q - dmin·m`), so it equals ggml's and the `gguf` package's
values bit for bit; the tests hold it against `gguf.quants.dequantize` as independent math.

Layouts (little endian, `d`, `m`, `dmin` fp16):
  Q8_0  [d][32 x int8]                         w = d·q
  Q4_0  [d][16 B: code j low, j+16 high]       w = d·(q - 8)
  Q4_1  [d][m][16 B]                           w = d·q + m
  Q5_0  [d][qh u32: bit j = code j's 5th][16 B] w = d·(q - 16)
  Q5_1  [d][m][qh][16 B]                       w = d·q + m
  Q4_K  [d][dmin][12 B: eight 6-bit scales and minimums][128 B: 64-weight chunks, low then high nibbles]
                                               w = (d·sc)·q - dmin·mn, per 32 weights
  Q5_K  Q4_K's with [32 B qh] before the codes: bit s of byte l is the 5th bit of weight l of sub-block s
  Q6_K  [128 B low 4 bits][64 B high 2 bits][16 x int8 scales][d]   w = (d·sc)·(q - 32), per 16 weights
  F32, F16, BF16 (a linear the file did not quantise, beside quantised ones: one weight a "block")
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .w4_layout import KeptDense

# The formats the engine computes with, by name: (weights a block, bytes a block) from gguf's own table.
BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    name: GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16")}
QK_K = 256


def format_id(name: str) -> int:
    """The format's GGML type number: what the engine file stores beside the bytes."""
    return int(GGMLQuantizationType[name])


def format_name(type_id: int) -> str:
    return GGMLQuantizationType(type_id).name


def row_bytes(fmt: str, k: int) -> int:
    weights, size = BLOCK_FORMATS[fmt]
    if k % weights:
        raise ValueError(f"{fmt} rows hold whole blocks of {weights} weights; {k} is not a multiple")
    return k // weights * size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] fp16 values as fp32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] codes: code j in byte j's low nibble, code j + 16 in its high one."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).int()


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes (a little-endian uint32) -> [B, 32] its bits, bit j at j."""
    j = torch.arange(32)
    return (qh[:, j // 8].int() >> (j % 8)) & 1


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [B, 12] -> eight 6-bit scales and eight 6-bit minimums [B, 8] (ggml's
    get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the nibbles of
    bytes 8-11 with their top two bits in the spare top bits of bytes 0-3 and 4-7."""
    sc = sc.int()
    low = torch.cat([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], dim=1)
    return low, mins


def _k_codes(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 8, 32] 4-bit codes: 64-weight chunk c holds sub-block 2c in the low nibbles
    of its 32 bytes and 2c + 1 in the high ones."""
    chunks = qs.reshape(-1, 4, 1, 32).int()
    return torch.cat([chunks & 0xF, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _dequant_blocks(fmt: str, b: torch.Tensor) -> torch.Tensor:
    """[B, bytes a block] -> [B, weights a block] float32."""
    if fmt == "Q8_0":
        return _f16(b[:, 0:2])[:, None] * b[:, 2:34].contiguous().view(torch.int8).float()
    if fmt == "Q4_0":
        return _f16(b[:, 0:2])[:, None] * (_low_high(b[:, 2:18]) - 8).float()
    if fmt == "Q4_1":
        return _f16(b[:, 0:2])[:, None] * _low_high(b[:, 4:20]).float() + _f16(b[:, 2:4])[:, None]
    if fmt == "Q5_0":
        q = _low_high(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
        return _f16(b[:, 0:2])[:, None] * (q - 16).float()
    if fmt == "Q5_1":
        q = _low_high(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
        return _f16(b[:, 0:2])[:, None] * q.float() + _f16(b[:, 2:4])[:, None]
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = _k_scales(b[:, 4:16])
        if fmt == "Q4_K":
            q = _k_codes(b[:, 16:144])
        else:   # bit s of qh byte l: the 5th bit of weight l of sub-block s
            q = _k_codes(b[:, 48:176]) | (((b[:, 16:48].int()[:, None, :] >> torch.arange(8)[:, None]) & 1) << 4)
        return ((d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]).reshape(-1, QK_K)
    if fmt == "Q6_K":
        # two halves of 128 weights; in half h, 32-weight run r takes low nibbles (r < 2) or high ones of
        # ql[64h + 32(r % 2) ...] and bits 2r, 2r+1 of qh[32h ...]; a scale per 16 weights
        ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32).int()
        qh = b[:, 128:192].reshape(-1, 2, 1, 32).int()
        low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
        high = (qh >> (2 * torch.arange(4)[:, None])) & 3
        q = (low | (high << 4)) - 32
        sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 4, 2, 1)
        d = _f16(b[:, 208:210])[:, None, None, None, None]
        return ((d * sc) * q.reshape(-1, 2, 4, 2, 16).float()).reshape(-1, QK_K)
    if fmt == "F32":
        return b.contiguous().view(torch.float32)
    if fmt == "F16":
        return b.contiguous().view(torch.float16).float()
    if fmt == "BF16":
        return b.contiguous().view(torch.bfloat16).float()
    raise ValueError(f"no dequantiser for GGUF type {fmt}")


def dequantize(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes uint8 [N, row bytes] in `fmt` -> its weights float32 [N, K]."""
    weights, size = BLOCK_FORMATS[fmt]
    n = raw.shape[0]
    return _dequant_blocks(fmt, raw.reshape(-1, size)).reshape(n, -1)


@dataclass
class BlockPart:
    """Consecutive output rows of a linear in one GGUF format: the file's bytes, uint8 [rows, row bytes]."""
    fmt: str
    raw: torch.Tensor

    @property
    def in_features(self) -> int:
        weights, size = BLOCK_FORMATS[self.fmt]
        return self.raw.shape[1] // size * weights


@dataclass
class BlockWeight(KeptDense):
    """A linear (a fused one: qkv, gate_up) as GGUF blocks: its output rows are the parts' rows in
    order, each part in its own format (a file may store q and v of one layer differently)."""
    parts: list[BlockPart]
    bias: torch.Tensor | None = None
    gemv_config: dict | None = None     # unused: the W4 GEMV's tuning has no meaning here
    keep_dense: bool = True             # as W4Weight: the CPU path keeps the dequantised matrix
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return sum(p.raw.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.raw.numel() for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([dequantize(p.fmt, p.raw.cpu()).to(p.raw.device) for p in self.parts]).to(dtype)



def block_linear_ref(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x [M, K] · Wᵀ (+ bias) with W dequantised (in x's dtype, as the kernel multiplies)."""
    return torch.nn.functional.linear(x, w.dense(x.dtype), None if w.bias is None else w.bias.to(x.dtype))


# -- in an engine's weights file ------------------------------------------------------------------------
def merge_parts(parts: list[BlockPart]) -> list[BlockPart]:
    """Neighbouring parts of one format become one (q and k both Q5_0: one launch, not two)."""
    out: list[BlockPart] = []
    for p in parts:
        if out and out[-1].fmt == p.fmt:
            out[-1] = BlockPart(p.fmt, torch.cat([out[-1].raw, p.raw]))
        else:
            out.append(p)
    return out


def to_tensors(prefix: str, parts: list[BlockPart]) -> dict[str, torch.Tensor]:
    """`prefix.blocks.j` (uint8 bytes of part j) and `prefix.block_types` (int32, each part's GGML type)."""
    out = {f"{prefix}.blocks.{j}": p.raw.contiguous() for j, p in enumerate(parts)}
    out[f"{prefix}.block_types"] = torch.tensor([format_id(p.fmt) for p in parts], dtype=torch.int32)
    return out


def is_stored(weights: dict[str, torch.Tensor], prefix: str) -> bool:
    return f"{prefix}.block_types" in weights


def from_tensors(weights: dict[str, torch.Tensor], prefix: str, device: torch.device) -> list[BlockPart]:
    types = weights[f"{prefix}.block_types"].tolist()
    return [BlockPart(format_name(t), weights[f"{prefix}.blocks.{j}"].to(device)) for j, t in enumerate(types)]
