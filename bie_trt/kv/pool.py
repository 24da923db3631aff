"""The KV pools: allocated once, addressed by block ids that are the same in every layer.

Layout (head-major inside a block, so one program reads one head's block contiguously):
  FP16 pool    k, v        [L, N_fp, H_kv, B, D]            activation dtype (fp16; fp32 on the CPU reference)
  INT4 pool    k_q, v_q    [L, N_q, H_kv, B, D // 2] uint8  two nibbles a byte: channel 2j low, 2j+1 high
               *_scale, *_zero [L, N_q, H_kv, B, D // G] fp16   x ≈ q · scale + zero   (q in 0..15)
  FP8 pool     k_q, v_q    [L, N_q, H_kv, B, D] float8_e4m3fn
               *_scale     [L, N_q, H_kv, B, 1] fp16          x ≈ q · scale

A block-table entry e >= 0 names FP16 block e; e < 0 names quantised block -e - 1
(`encode_quant_block` / `decode_block`), so one int32 table carries each block's precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KVCacheConfig, ModelConfig


def encode_quant_block(block_id: int) -> int:
    return -block_id - 1


def decode_block(entry: int) -> tuple[bool, int]:
    """Block-table entry -> (is_quantised, block id in its pool)."""
    return (True, -entry - 1) if entry < 0 else (False, entry)


def quant_bytes_per_token_per_layer(model: ModelConfig, kv: KVCacheConfig) -> int:
    """Bytes one token costs in one layer of the quantised pool (K and V)."""
    per_head = {
        "fp16": 2 * model.head_dim,
        "fp8": model.head_dim + 2,
        "int4_asym": model.head_dim // 2 + 4 * (model.head_dim // kv.group_size),
    }[kv.dtype]
    return 2 * model.num_kv_heads * per_head


@dataclass
class KVPools:
    cfg: KVCacheConfig
    k: torch.Tensor
    v: torch.Tensor
    k_q: torch.Tensor | None = None
    v_q: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    scratch_block: int | None = None   # an FP16 block no sequence owns: CUDA-graph padding writes here

    @property
    def num_fp_blocks(self) -> int:
        """FP16 blocks sequences may own (the scratch block, when there is one, is the last)."""
        return self.k.shape[1] - (self.scratch_block is not None)

    @property
    def num_quant_blocks(self) -> int:
        return 0 if self.k_q is None else self.k_q.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("k", "v", "k_q", "v_q", "k_scale", "v_scale", "k_zero", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes of the FP16 pool and of the quantised pool."""
        fp = self.k.nbytes + self.v.nbytes
        q = sum(t.nbytes for n, t in self.tensors().items() if n not in ("k", "v"))
        return {"fp16": fp, "quant": q}


def allocate_pools(
    model: ModelConfig,
    kv: KVCacheConfig,
    num_fp_blocks: int,
    num_quant_blocks: int,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    scratch_block: bool = False,
) -> KVPools:
    """Allocate every pool tensor once. `num_quant_blocks` is ignored for fp16 KV."""
    L, H, B, D = model.num_layers, model.num_kv_heads, kv.block_size, model.head_dim
    fp_shape = (L, num_fp_blocks + scratch_block, H, B, D)
    pools = KVPools(kv, torch.zeros(fp_shape, dtype=dtype, device=device),
                    torch.zeros(fp_shape, dtype=dtype, device=device),
                    scratch_block=num_fp_blocks if scratch_block else None)
    if kv.dtype == "fp16" or num_quant_blocks == 0:
        return pools
    qshape = (L, num_quant_blocks, H, B)
    if kv.dtype == "int4_asym":
        G = kv.group_size
        for side in ("k", "v"):
            setattr(pools, f"{side}_q", torch.zeros(qshape + (D // 2,), dtype=torch.uint8, device=device))
            setattr(pools, f"{side}_scale", torch.zeros(qshape + (D // G,), dtype=torch.float16, device=device))
            setattr(pools, f"{side}_zero", torch.zeros(qshape + (D // G,), dtype=torch.float16, device=device))
    else:  # fp8
        for side in ("k", "v"):
            setattr(pools, f"{side}_q", torch.zeros(qshape + (D,), dtype=torch.float8_e4m3fn, device=device))
            setattr(pools, f"{side}_scale", torch.zeros(qshape + (1,), dtype=torch.float16, device=device))
    return pools
