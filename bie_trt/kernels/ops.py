"""The one dispatcher: every device-specific op the model calls goes through here.

CUDA tensors take the Triton kernels; CPU tensors take the plain-torch reference twins, which
are also the kernels' test oracles. `BIE_TRT_KERNELS=triton` forces the Triton kernels (tests run
them on the CPU under TRITON_INTERPRET=1); `=reference` forces the twins everywhere.
`BIE_TRT_ATTENTION=v2` runs the paged attention's v2 tile loop instead of v1 (the default).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..kv import quant
from ..kv.pool import KVPools
from . import delta_rule
from . import reference as ref
from .attention_ref import (DensePrefills, paged_decode_attention_ref, paged_prefills_dense, paged_tile_attention_ref,
                            tile_chunks)
from .gguf_blocks import BlockWeight, block_linear_ref
from .int8_rows import Int8Rows
from .key_offset import KeyOffset
from .w4_layout import W4Weight

if TYPE_CHECKING:
    from .step_inputs import StepMetadata, StepTiles

# The CPU path folds 64 blocks (1,024 tokens) per online-softmax step: same algorithm as the
# one-block oracle, far fewer Python iterations.
CPU_BLOCKS_PER_TILE = 64


def use_triton(x: torch.Tensor) -> bool:
    choice = os.environ.get("BIE_TRT_KERNELS", "auto")
    if choice == "reference" or not (choice == "triton" or x.is_cuda):
        return False
    try:
        from . import triton_ops
    except ImportError:  # no triton on this machine: the twins run everywhere
        return False
    return triton_ops.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from .triton_ops import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return ref.rms_norm_ref(x, weight, eps, residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from .triton_ops import silu_mul_triton

        return silu_mul_triton(gate_up)
    return ref.silu_mul_ref(gate_up)


def block_linear(x: torch.Tensor, w: BlockWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x · Wᵀ (+ residual) with W in a GGUF file's own blocks (gguf_blocks.py)."""
    if use_triton(x):
        from .triton_gguf import block_linear_triton

        return block_linear_triton(x, w, residual)
    y = block_linear_ref(x, w)
    return y if residual is None else y + residual


def w4_linear(x: torch.Tensor, w: W4Weight | BlockWeight) -> torch.Tensor:
    if isinstance(w, BlockWeight):
        return block_linear(x, w)
    if use_triton(x):
        from .triton_w4 import w4_linear_triton

        return w4_linear_triton(x, w, w.gemv_config if x.shape[0] == 1 else None)
    return ref.w4_linear_ref(x, w)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: W4Weight | BlockWeight,
                glu: str | None = None) -> torch.Tensor:
    """w4_linear(rms_norm(x)), then act(gate)·up when w is gate_up and `glu` names act ("silu", "gelu_tanh"):
    one launch on the GPU for SiLU; GELU's gating runs behind the fused norm and GEMM (`glu_ref`). GGUF
    blocks: the norm, the linear and the gating each their own launch."""
    if isinstance(w, BlockWeight):
        y = block_linear(rms_norm(x, norm_weight, eps)[0], w)
        return ref.glu_ref(y, glu) if glu else y
    if use_triton(x):
        from .triton_w4 import w4_linear_triton

        fused = glu == "silu"
        y = w4_linear_triton(x, w, w.gemv_config if x.shape[0] == 1 else None, norm_weight=norm_weight, eps=eps,
                             silu_mul=fused)
        return y if fused or glu is None else ref.glu_ref(y, glu)
    y = ref.w4_linear_ref(ref.rms_norm_ref(x, norm_weight, eps)[0], w)
    return ref.glu_ref(y, glu) if glu else y


def linear_residual(x: torch.Tensor, w: W4Weight | BlockWeight, residual: torch.Tensor) -> torch.Tensor:
    """residual + w4_linear(x), added in the activation dtype: one launch on the GPU."""
    if isinstance(w, BlockWeight):
        return block_linear(x, w, residual)
    if use_triton(x):
        from .triton_w4 import w4_linear_triton

        return w4_linear_triton(x, w, w.gemv_config if x.shape[0] == 1 else None, residual=residual)
    return ref.w4_linear_ref(x, w) + residual


# The torch path dequantises the head into the activation dtype and multiplies that: about five bytes
# moved per int8 weight. Each 16-row kernel launch reads the head once (one byte), so up to four
# launches (64 rows: a speculative verify of several sequences) still move less.
INT8_HEAD_LAUNCHES_BEFORE_DEQUANT = 4


def norm_int8_rows_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, head: Int8Rows) -> torch.Tensor:
    """Logits from the int8 lm_head of rms_norm(x): one Triton launch per 16 rows up to 64 rows (decode,
    verify), the dequantising torch path beyond (an evaluation's whole chunk)."""
    if use_triton(x):
        from .triton_int8 import MAX_ROWS, int8_rows_linear_triton

        if x.shape[0] <= MAX_ROWS * INT8_HEAD_LAUNCHES_BEFORE_DEQUANT:
            out = [int8_rows_linear_triton(rows, head, norm_weight=norm_weight, eps=eps) for rows in x.split(MAX_ROWS)]
            return out[0] if len(out) == 1 else torch.cat(out)
    return head.linear(rms_norm(x, norm_weight, eps)[0])


def write_kv(pools: KVPools, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    if use_triton(k):
        from .triton_ops import write_kv_triton

        return write_kv_triton(pools, layer, k, v, slot_blocks, slot_offsets)
    return ref.write_kv_ref(pools, layer, k, v, slot_blocks, slot_offsets)


def qkv_epilogue(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                 inv_freq: torch.Tensor, key_mean: torch.Tensor | None, rotate_keys: bool, rotate_values: bool,
                 pools: KVPools, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                 qk_norm: ref.QKNorm | None = None, key_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, KeyOffset | None]:
    """qkv rows -> attention's q [T, H_q, D] and, with key centering (key_mean, the pre-RoPE mean key), what
    attention adds back for it; the per-head q/k norms (Qwen3), RoPE, key centering, the per-pair key scale and
    rotation applied, K/V written."""
    if use_triton(qkv):
        from .triton_ops import qkv_epilogue_triton as fn
    else:
        fn = ref.qkv_epilogue_ref
    q, coefficients = fn(qkv, num_heads, num_kv_heads, positions, inv_freq, key_mean, rotate_keys, rotate_values,
                         pools, layer, slot_blocks, slot_offsets, qk_norm, key_scale)
    return q, KeyOffset(coefficients, inv_freq) if coefficients is not None else None


def quantize_block(pools: KVPools, fp_block: int, q_block: int) -> None:
    """Quantise one FP16 block (all layers, K and V) into a quantised block: a block leaving the window."""
    if use_triton(pools.k) and pools.cfg.scale_scope == "group":   # the block-scope ablation stays in torch
        from .triton_ops import quantize_block_triton

        return quantize_block_triton(pools, fp_block, q_block)
    return quant.quantize_block(pools, None, fp_block, q_block)


def quantize_layer_blocks(pools: KVPools, layer: int, fp_blocks: list[int], q_blocks: list[int]) -> None:
    """Quantise one layer of several FP16 blocks, for a step that reads in a layer what it wrote there."""
    quant.quantize_block(pools, layer, fp_blocks, q_blocks)


def attention_config() -> dict:
    """The paged attention's engine-wide settings: the tile loop `BIE_TRT_ATTENTION` names (v1 unset)."""
    return {"variant": os.environ.get("BIE_TRT_ATTENTION", "v1")}


def paged_decode_attention(q: torch.Tensor, pools: KVPools, layer: int, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           offset: KeyOffset | None = None) -> torch.Tensor:
    """One query per sequence, q [S, H_q, D]; block_tables int32 [S, max_blocks]. `window` > 0 (a
    sliding-window layer): each query sees the last `window` positions only, the blocks below unread.
    `offset`: what centred keys' scores get back (key_offset.py), or None."""
    if use_triton(q):
        from .triton_attention import paged_decode_attention as kernel

        return kernel(q, pools, layer, block_tables, context_lens, scale, config=attention_config(), window=window,
                      offset=offset)
    return paged_decode_attention_ref(q, pools, layer, block_tables, context_lens, scale, CPU_BLOCKS_PER_TILE,
                                      window, offset)


def paged_prefill_attentions(q: torch.Tensor, pools: KVPools, layer: int, meta: StepMetadata,
                             scale: float, window: int = 0, offset: KeyOffset | None = None) -> list[torch.Tensor]:
    """Attention of each multi-token chunk of a step, meta.prefills' (first row, tokens, table) each, q [T, H_q, D]
    (the chunks already written). On the CPU, dense masked attention over tiles of the chunks' rows, laid out
    at the first layer and kept in `meta` for the others."""
    if use_triton(q):
        from .triton_attention import paged_prefill_attention as kernel

        return [kernel(q[s:s + n], pools, layer, table, meta.positions[s:s + n], scale, config=attention_config(),
                       window=window, offset=offset.rows(slice(s, s + n)) if offset is not None else None)
                for s, n, table in meta.prefills]
    if meta.dense_prefills is None:
        meta.dense_prefills = DensePrefills.build(meta.prefills, meta.positions, pools.cfg.block_size)
    return paged_prefills_dense(q, pools, layer, meta.dense_prefills, scale, window, offset)


def paged_tile_attention(q: torch.Tensor, pools: KVPools, layer: int, tiles: StepTiles, scale: float,
                         window: int = 0, offset: KeyOffset | None = None) -> torch.Tensor:
    """Every row of a tiled step (a speculative verify of many sequences, decodes beside it) in one launch,
    each query tile through its own table (`StepTiles`), q [T, H_q, D]. On the CPU, dense masked
    attention over the tiles, laid out at the first layer and kept in `tiles` for the others."""
    if use_triton(q):
        from .triton_attention import paged_tile_attention as kernel

        return kernel(q, pools, layer, tiles.tiles, tiles.tables, tiles.positions, scale, tiles.block_m,
                      config=attention_config(), window=window, offset=offset)
    if tiles.dense is None:
        tiles.dense = DensePrefills.build(tile_chunks(tiles.tiles, tiles.tables), tiles.positions, pools.cfg.block_size)
    return paged_tile_attention_ref(q, pools, layer, tiles.tiles, tiles.tables, tiles.positions, scale, tiles.dense,
                                    window, offset)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """S sequences of T tokens through a Gated DeltaNet layer's delta rule, each from and back into its state
    slot (`delta_rule.delta_rule_slots`): a decode batch, or a prefill chunk. Outputs [S, T, H, V] fp32."""
    if use_triton(q):
        from .triton_delta_rule import delta_rule_slots_triton

        return delta_rule_slots_triton(q, k, v, g, beta, states, slots)
    return delta_rule.delta_rule_slots(q, k, v, g, beta, states, slots)
