"""How big the KV pools are, per layer type: the one formula the memory plan prints and the runtime
allocates (`ModelRunner` through `kv_pool_blocks` and `sliding_pool_blocks`), so the two never disagree.

A dense model has one cache group: every layer's K/V in the FP16 pool (sinks, the recent window, the chunk
in flight) and, with a quantised cache, the body in the quantised pool, both addressed by one block table.
A hybrid model (Gemma 3: five sliding-window layers to one full layer) has two: the full layers keep that
layout, the sliding layers an FP16 pool of their own that holds only each sequence's window (plus a block,
because the window rarely starts on a block boundary, plus the prefill chunk in flight): blocks that slide
out of the window go back to it (cache_tiers/sliding_blocks.py). Pure arithmetic, no tensors.
"""
from __future__ import annotations

import math

from ..config import KVCacheConfig, ModelConfig
from ..errors import PlanError
from .pool import quant_bytes_per_token_per_layer

FP16 = 2


def full_layers(model: ModelConfig) -> int:
    """Layers that attend over the whole context with a cache of their own (all of a dense model's; not sliding,
    not linear attention, not Gemma 4's KV-shared layers)."""
    return model.cache_layers()


def fp16_kv_bytes_per_token(model: ModelConfig, layers: int | None = None, sliding: bool = False) -> int:
    """K and V of one token, fp16, in `layers` layers (every layer by default) with the full-attention (or the
    sliding) layers' heads."""
    layers = model.num_layers if layers is None else layers
    heads, head_dim = model.cache_shape(sliding)
    return 2 * layers * heads * head_dim * FP16


def kv_bytes_per_token(model: ModelConfig, kv: KVCacheConfig) -> int:
    """What one more token of context costs: the full layers' quantised body (fp16 when KV is fp16).
    Sliding layers cost nothing more past their window."""
    if kv.dtype == "fp16":
        return fp16_kv_bytes_per_token(model, full_layers(model))
    return quant_bytes_per_token_per_layer(model, kv) * full_layers(model)


def bounded_fp_blocks_per_seq(kv: KVCacheConfig, window: int, chunked_prefill_size: int) -> int:
    """FP16 blocks one sequence needs when only its sinks and recent window stay FP16.

    Sinks and window as blocks, plus one prefill chunk (its tokens land in FP16 before older
    blocks are quantised or dropped; speculative tokens also land here), plus one block because
    the window rarely starts on a block boundary.
    """
    b = kv.block_size
    return math.ceil(kv.sink_tokens / b) + math.ceil(window / b) + math.ceil(chunked_prefill_size / b) + 1


def sliding_blocks_per_seq(model: ModelConfig, kv: KVCacheConfig, max_model_len: int,
                           chunked_prefill_size: int) -> int:
    """Blocks one sequence holds in the sliding layers' pool at most: its window, one more block (the window
    rarely starts on a boundary) and a prefill chunk (or a verify's rows), never more than the context;
    0 for a dense model. The row at position p reads p - window + 1 .. p, so a step from position c over n
    rows holds blocks (c - window + 1) // B .. (c + n - 1) // B."""
    if not model.sliding_layers:
        return 0
    b = kv.block_size
    bounded = math.ceil(int(model.sliding_window) / b) + 1 + math.ceil(chunked_prefill_size / b)
    return min(math.ceil(max_model_len / b), bounded)


def kv_pool_blocks(
    model: ModelConfig, kv: KVCacheConfig, max_model_len: int, max_num_seqs: int, chunked_prefill_size: int
) -> tuple[int, int]:
    """(FP16 blocks, quantised blocks) of the full layers' pools (every layer's, for a dense model) that the
    runtime allocates with `kv.pool.allocate_kv`."""
    check_max_model_len(model, max_model_len)
    full = max_num_seqs * math.ceil(max_model_len / kv.block_size)
    if kv.dtype == "fp16":
        return full, 0
    return max_num_seqs * bounded_fp_blocks_per_seq(kv, kv.window, chunked_prefill_size), full


def sliding_pool_blocks(model: ModelConfig, kv: KVCacheConfig, max_model_len: int, max_num_seqs: int,
                        chunked_prefill_size: int) -> int:
    """FP16 blocks of the sliding layers' pool (0 for a dense model), allocated with `kv.pool.allocate_kv`."""
    return max_num_seqs * sliding_blocks_per_seq(model, kv, max_model_len, chunked_prefill_size)


def kv_pool_bytes(model: ModelConfig, kv: KVCacheConfig, num_fp_blocks: int, num_quant_blocks: int) -> tuple[int, int]:
    """Bytes of the full layers' FP16 pool and quantised pool with fp16 activations (= `KVPools.nbytes()`)."""
    b, layers = kv.block_size, full_layers(model)
    fp = num_fp_blocks * b * fp16_kv_bytes_per_token(model, layers)
    if kv.dtype == "fp16":
        return fp, 0
    return fp, num_quant_blocks * b * quant_bytes_per_token_per_layer(model, kv) * layers


def sliding_pool_bytes(model: ModelConfig, kv: KVCacheConfig, num_sliding_blocks: int) -> int:
    """Bytes of the sliding layers' FP16 pool (= `KVPools.nbytes()["sliding"]`)."""
    return num_sliding_blocks * kv.block_size * fp16_kv_bytes_per_token(model, model.cache_layers(sliding=True),
                                                                           sliding=True)


def check_max_model_len(model: ModelConfig, max_model_len: int) -> None:
    if max_model_len <= 0:
        raise PlanError(f"max_model_len must be positive; got {max_model_len}.")
    if max_model_len > model.max_positions:
        where = ("YaRN's factor x original_max_position_embeddings in config.json"
                 if model.max_positions != model.max_position_embeddings else "max_position_embeddings in config.json")
        raise PlanError(
            f"max_model_len {max_model_len:,} is beyond the model's limit of {model.max_positions:,} "
            f"tokens ({where}); use --max-model-len <= {model.max_positions:,}."
        )
