"""The KV pools: allocated once, addressed by block ids that are the same in every layer of a cache group.

A hybrid model (sliding-window and full-attention layers, kv/sizing.py) has two groups: the full layers'
pools (the `KVPools` the engine passes around, layer l of it being the l-th full layer) carry the sliding
layers' own FP16 pools in `sliding` (layer l there: the l-th sliding layer), addressed by block tables of
their own. A dense model has one group: `sliding` is None and layer l is the model's layer l.

Layout (head-major inside a block, so one program reads one head's block contiguously):
  FP16 pool    k, v        [L, N_fp, H_kv, B, D]            activation dtype (fp16; fp32 on the CPU reference)
  quantised    k_pack, v_pack [L, N_q, H_kv, R] uint8       one (block, head) = R contiguous bytes: its codes,
               then its scale/zero record, so the loads that fetch a block's codes reach its record too
  INT4         codes   [B, D // 2]  two nibbles a byte: channel 2j low, 2j+1 high
               record  [B, D // G, 2] fp16 (scale, zero) pairs       x ≈ q · scale + zero   (q in 0..15)
  FP8          codes   [B, D] float8_e4m3fn
               record  [B, 1] fp16 scale                             x ≈ q · scale

`k_q`, `k_scale`, `k_zero` (and the `v_` ones) are views into the packs with the shapes of the
separate tensors they once were ([L, N_q, H_kv, B, D // 2] and [L, N_q, H_kv, B, D // G] for INT4,
[L, N_q, H_kv, B, D] and [L, N_q, H_kv, B, 1] for FP8): quantisers and the reference read and write
through them; `tensors()` lists the storage (k, v and the packs), so copying a pool keeps them aliased.

A block-table entry e >= 0 names FP16 block e; e < 0 names quantised block -e - 1
(`encode_quant_block` / `decode_block`), so one int32 table carries each block's precision.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..config import KVCacheConfig, ModelConfig
from .recurrent import RecurrentStates


def encode_quant_block(block_id: int) -> int:
    return -block_id - 1


def decode_block(entry: int) -> tuple[bool, int]:
    """Block-table entry -> (is_quantised, block id in its pool)."""
    return (True, -entry - 1) if entry < 0 else (False, entry)


def quant_bytes_per_token_per_head(kv: KVCacheConfig, head_dim: int) -> int:
    """Bytes of one token of one head in the quantised pool, one side (K or V): codes and record."""
    return {
        "fp16": 2 * head_dim,
        "fp8": head_dim + 2,
        "int4_asym": head_dim // 2 + 4 * (head_dim // kv.group_size),
    }[kv.dtype]


def quant_bytes_per_token_per_layer(model: ModelConfig, kv: KVCacheConfig) -> int:
    """Bytes one token costs in one layer of the quantised pool (K and V): a full-attention layer."""
    heads, head_dim = model.cache_shape()
    return 2 * heads * quant_bytes_per_token_per_head(kv, head_dim)


def pack_views(pack: torch.Tensor, kv: KVCacheConfig, block_size: int, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scale, zero) views of a pack [..., R]; zero is None for FP8."""
    B, D = block_size, head_dim
    if kv.dtype == "int4_asym":
        codes = pack[..., :B * D // 2].unflatten(-1, (B, D // 2))
        record = pack[..., B * D // 2:].view(torch.float16).unflatten(-1, (B, D // kv.group_size, 2))
        return codes, record[..., 0], record[..., 1]
    codes = pack[..., :B * D].view(torch.float8_e4m3fn).unflatten(-1, (B, D))
    return codes, pack[..., B * D:].view(torch.float16).unflatten(-1, (B, 1)), None


@dataclass
class KVPools:
    cfg: KVCacheConfig
    k: torch.Tensor
    v: torch.Tensor
    k_pack: torch.Tensor | None = None
    v_pack: torch.Tensor | None = None
    scratch_block: int | None = None   # an FP16 block no sequence owns: CUDA-graph padding writes here
    sliding: "KVPools | None" = None   # a hybrid model's sliding-window layers (FP16 only), see the docstring
    recurrent: RecurrentStates | None = None   # linear-attention layers' state slots (kv/recurrent.py)
    # Views into the packs (see the module docstring), made from them.
    k_q: torch.Tensor | None = field(init=False, default=None)
    v_q: torch.Tensor | None = field(init=False, default=None)
    k_scale: torch.Tensor | None = field(init=False, default=None)
    v_scale: torch.Tensor | None = field(init=False, default=None)
    k_zero: torch.Tensor | None = field(init=False, default=None)
    v_zero: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        block_size, head_dim = self.k.shape[-2], self.k.shape[-1]
        for side in ("k", "v"):
            pack = getattr(self, f"{side}_pack")
            if pack is None:
                continue
            expected = block_size * quant_bytes_per_token_per_head(self.cfg, head_dim)
            if pack.dtype != torch.uint8 or pack.shape[-1] != expected or pack.stride(-1) != 1:
                raise ValueError(f"{side}_pack must be uint8 [..., {expected}] with contiguous bytes for "
                                 f"{self.cfg.dtype} blocks of {block_size} x {head_dim}; got {pack.dtype} "
                                 f"{tuple(pack.shape)}.")
            codes, scale, zero = pack_views(pack, self.cfg, block_size, head_dim)
            setattr(self, f"{side}_q", codes)
            setattr(self, f"{side}_scale", scale)
            setattr(self, f"{side}_zero", zero)

    @property
    def num_fp_blocks(self) -> int:
        """FP16 blocks sequences may own (the scratch block, when there is one, is the last)."""
        return self.k.shape[1] - (self.scratch_block is not None)

    @property
    def num_quant_blocks(self) -> int:
        return 0 if self.k_pack is None else self.k_pack.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The storage (k, v and the packs): the views share it."""
        names = ("k", "v", "k_pack", "v_pack")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def quant_views(self) -> dict[str, torch.Tensor]:
        """The quantised pool's views by name (k_q, k_scale, k_zero, v_...), those the format has."""
        names = ("k_q", "v_q", "k_scale", "v_scale", "k_zero", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes of the FP16 pool and of the quantised pool (and of a hybrid model's sliding pool)."""
        fp = self.k.nbytes + self.v.nbytes
        q = sum(t.nbytes for n, t in self.tensors().items() if n not in ("k", "v"))
        return {"fp16": fp, "quant": q} | ({"sliding": self.sliding.nbytes()["fp16"]} if self.sliding else {})


def allocate_pools(
    model: ModelConfig,
    kv: KVCacheConfig,
    num_fp_blocks: int,
    num_quant_blocks: int,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    scratch_block: bool = False,
    num_layers: int | None = None,
    sliding: bool = False,
) -> KVPools:
    """Allocate every pool tensor once, for `num_layers` layers (the model's by default) of the full-attention
    (or with `sliding` the sliding) layers' heads. `num_quant_blocks` is ignored for fp16 KV."""
    L = model.num_layers if num_layers is None else num_layers
    (H, D), B = model.cache_shape(sliding), kv.block_size
    fp_shape = (L, num_fp_blocks + scratch_block, H, B, D)
    packs = {}
    if kv.dtype != "fp16" and num_quant_blocks:
        shape = (L, num_quant_blocks, H, B * quant_bytes_per_token_per_head(kv, D))
        packs = {f"{side}_pack": torch.zeros(shape, dtype=torch.uint8, device=device) for side in ("k", "v")}
    return KVPools(kv, torch.zeros(fp_shape, dtype=dtype, device=device),
                   torch.zeros(fp_shape, dtype=dtype, device=device), **packs,
                   scratch_block=num_fp_blocks if scratch_block else None)


def sliding_config(kv: KVCacheConfig) -> KVCacheConfig:
    """The sliding layers' cache: FP16 (bounded by the window, quantising would save little and cost
    quality), no sinks or window of its own, the same blocks."""
    return dataclasses.replace(kv, dtype="fp16", sink_tokens=0, window=0)


def allocate_kv(model: ModelConfig, kv: KVCacheConfig, num_fp_blocks: int, num_quant_blocks: int,
                num_sliding_blocks: int, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu",
                scratch_block: bool = False) -> KVPools:
    """Every cache group's pools (kv/sizing.kv_pool_blocks gives the counts): a dense model's, or a hybrid
    model's full layers with its sliding layers' pools in `sliding`."""
    pools = allocate_pools(model, kv, num_fp_blocks, num_quant_blocks, dtype, device, scratch_block,
                           num_layers=model.cache_layers())
    if model.sliding_layers:
        pools.sliding = allocate_pools(model, sliding_config(kv), num_sliding_blocks, 0, dtype, device, scratch_block,
                                       num_layers=model.cache_layers(sliding=True), sliding=True)
    return pools
