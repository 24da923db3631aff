"""Key centering: the calibrated mean key per layer and KV head, subtracted before keys reach the cache.

Keys share a large component across tokens: on SmolLM2 the mean key's RMS is larger than the
RMS of what varies from token to token. Per-token INT4 (and FP8's per-token absmax) spends its
levels covering that shared offset. The offset is fixed before RoPE, so the mean is taken there
(the calibration's post-RoPE keys turned back by their positions) and subtracted before RoPE: the
cache holds R(p)(k − m) at every position p, and attention adds q·R(p)m back to each score exactly
(kernels/key_offset.py). A post-RoPE mean subtracted as one fixed vector would need nothing added
back (one constant per query), but RoPE turns the true offset away from it as positions grow: on
Qwen2.5-Coder-0.5B at 32k that cost +3.5% perplexity. m is measured once, at build time, on a short
fixed text. The build turns it on where the keys' measured rounding error calls for it (kv_choice.py:
Qwen2's k_proj bias makes the mean nearly the whole key in a few layers); on SmolLM2 it stays off.
Gemma 3 builds always turn it on (config_gemma3.FAMILY.kv_defaults): there its k-normed keys' mean is
most of each key (docs/kv-cache-quality.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import KVCacheConfig
from ..cache_tiers.block_manager import BlockManager
from ..executor.sequence import Sequence
from ..kernels.step_inputs import SeqInput
from ..kv.pool import allocate_pools
from ..kv.recurrent import allocate_recurrent
from ..model.llama import LlamaModel
from ..sampling import make_generator
from ..sampling_params import SamplingParams

CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"
CALIBRATION_TOKENS = 512
# The first positions are attention sinks with atypical keys; they stay FP16 and would bias the mean.
SKIP_POSITIONS = 16


@dataclass
class Calibration:
    """One forward over the calibration text, past its first `skip` positions: every attention layer's post-RoPE
    keys and its values [L, Hkv, T, D] fp32 (zeros for a linear-attention layer, which keeps none), the queries
    each layer attended with (li -> [H, T, D_li]) and the model's softmax scale."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: dict[int, torch.Tensor]
    softmax_scale: float
    first_position: int = SKIP_POSITIONS   # the position of the first key kept


@torch.inference_mode()
def calibration_pass(model: LlamaModel, token_ids: list[int], skip: int = SKIP_POSITIONS) -> Calibration:
    """Runs `model` once over token_ids with an FP16 cache (no centering, scale or rotation: the raw keys)."""
    if len(token_ids) <= skip:
        raise ValueError(f"key calibration needs more than {skip} tokens; got {len(token_ids)}.")
    cfg, kv = model.cfg, KVCacheConfig(dtype="fp16")
    attention = [i for i in range(cfg.num_layers) if i not in cfg.linear_layers]
    n_blocks = -(-len(token_ids) // kv.block_size)
    pools = allocate_pools(cfg, kv, n_blocks, 0, model.dtype, model.device, num_layers=len(attention))
    slot = None
    if cfg.linear_layers:   # Qwen3.5: the DeltaNet layers run from a zero state, in a slot of their own
        pools.recurrent = allocate_recurrent(cfg, 1, model.dtype, model.device)
        slot = pools.recurrent.allocate()
    # One prompt, its blocks laid out by the block manager as serving lays them out
    seq = Sequence(list(token_ids), SamplingParams(temperature=0), make_generator(SamplingParams(), 0))
    BlockManager(kv, n_blocks, 0).grow(seq, len(token_ids))
    model.recorded_queries = {}
    try:
        model.forward([SeqInput(torch.tensor(token_ids, device=model.device), 0, seq.block_table, state_slot=slot)],
                      pools)
        queries = {li: q[skip:].transpose(0, 1).cpu() for li, q in model.recorded_queries.items()}
    finally:
        model.recorded_queries = None

    def rows(pool: torch.Tensor) -> torch.Tensor:
        # Pool layout [L, blocks, Hkv, block, D]: the table's blocks, in order, hold positions 0..
        found = pool[:, seq.block_table].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, skip:len(token_ids)]
        out = found.new_zeros(cfg.num_layers, *found.shape[1:])
        out[attention] = found
        return out.float().cpu()

    return Calibration(rows(pools.k), rows(pools.v), queries, model.scale, skip)


def calibration_ids(tokenizer) -> list[int]:
    return list(tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:CALIBRATION_TOKENS])
