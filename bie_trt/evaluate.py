"""KV-cache quality: perplexity and KL divergence from the FP16-KV run, scored as decode sees them.

Every variant runs over the same windows as an FP16-KV baseline, sharing one copy of the weights.
A window goes through one forward as one sequence whose rows read the cache exactly as plain
decoding does at their positions (the engine's own mechanism, executor/exact_rows.py): its rows
are cut where the blocks read quantised change, each run with its block table (and into block-sized
slices), and the blocks the window itself writes and later rows read quantised are quantised per
layer between writing K/V and attention.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from .config import EngineConfig, KVCacheConfig
from .errors import BieError
from .executor.block_manager import BlockManager
from .executor.model_runner import ModelRunner
from .executor.sequence import Sequence
from .kernels.step_inputs import SeqInput
from .kv.pool import KVPools, allocate_kv
from .model.llama import LlamaModel
from .plan import kv_bytes_per_token
from .sampling import make_generator
from .sampling_params import SamplingParams


@dataclass
class EvalResult:
    label: str
    kv: dict
    ppl: float
    kld: float
    tokens: int
    context: int
    kv_bytes_per_token: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Variant:
    label: str
    kv: KVCacheConfig
    pools: KVPools | None   # None: the reference, whose logits come from elsewhere
    nll: float = 0.0
    kl: float = 0.0


def ablation_variants(base: KVCacheConfig) -> dict[str, KVCacheConfig]:
    """The quality table's rows: each ingredient of the INT4 cache taken away in turn."""
    int4 = dataclasses.replace(base, dtype="int4_asym")
    return {
        "fp8": dataclasses.replace(base, dtype="fp8"),
        "int4 (all on)": int4,
        "int4 no sinks": dataclasses.replace(int4, sink_tokens=0),
        "int4 no window": dataclasses.replace(int4, window=0),
        "int4 no rotation": dataclasses.replace(int4, rotation="none"),
        f"int4 key centering {'off' if int4.key_centering else 'on'}":
            dataclasses.replace(int4, key_centering=not int4.key_centering),
        "int4 none of them": dataclasses.replace(int4, sink_tokens=0, window=0, rotation="none", key_centering=False),
        "int4 one scale per block": dataclasses.replace(int4, scale_scope="block"),
    }


def _windows(n_tokens: int, context: int, stride: int, first: int, max_windows: int | None) -> list[int]:
    starts = list(range(0, n_tokens - context + 1, stride))[first:]
    return starts[:max_windows] if max_windows else starts


def evaluate(engine_dir: str | Path, token_ids: list[int], context: int, variants: dict[str, KVCacheConfig],
             stride: int | None = None, max_windows: int | None = None,
             first_window: int = 0, device: str = "cpu", progress: bool = True,
             reference: tuple[str, Callable[[list[int]], torch.Tensor]] | None = None) -> list[EvalResult]:
    """Perplexity and mean KL(P_base || P_variant) per variant; the baseline comes first. The baseline is the
    engine with an FP16 cache, or `reference` = (label, ids -> logits [len(ids), V]): another model's logits,
    such as the source GGUF's own weights (builder/eval_reference.py)."""
    stride = stride or context
    if not 0 < stride <= context:
        raise BieError(f"stride must be in (0, context]; got {stride}.")
    runner = ModelRunner(EngineConfig(engine_dir=str(engine_dir), device=device, max_num_seqs=1,
                                      num_kv_blocks=1, kv_cache_dtype="fp16"))
    model_cfg = runner.model_config
    if context > model_cfg.max_positions:
        raise BieError(f"context {context} is beyond the model's {model_cfg.max_positions} positions.")
    starts = _windows(len(token_ids), context, stride, first_window, max_windows)
    if not starts:
        raise BieError(f"the text has {len(token_ids)} tokens, fewer than one window of {context}; "
                       f"use a smaller --context or a longer file.")
    base_kv = runner.kv_config
    for kv in variants.values():
        kv.validate(model_cfg.head_dim)
    n_blocks = -(-context // base_kv.block_size) + 1
    n_sliding = n_blocks if model_cfg.sliding_layers else 0   # a hybrid model's sliding layers stay FP16 (kv/pool.py)
    fp16 = dataclasses.replace(base_kv, dtype="fp16")
    all_variants = [_Variant(reference[0], fp16, None) if reference else
                    _Variant("fp16", fp16, allocate_kv(model_cfg, fp16, n_blocks, 0, n_sliding, runner.dtype,
                                                       runner.device))]
    for label, kv in variants.items():
        all_variants.append(_Variant(label, kv, allocate_kv(model_cfg, kv, n_blocks, n_blocks, n_sliding, runner.dtype,
                                                            runner.device)))
    scored = 0
    bar = tqdm(total=len(starts) * len(all_variants), desc=f"eval ctx {context}", unit="pass", disable=not progress)
    for start in starts:
        window = token_ids[start:start + context]
        score_from = 0 if start == 0 else context - stride   # score only tokens no earlier window scored
        targets = torch.tensor(window[1:])
        keep = torch.arange(1, context) >= max(score_from, 1)
        base_logp = []
        for v in all_variants:
            logits = (reference[1](window[:-1]) if v.pools is None else
                      _teacher_forced_logits(runner.model, v, window[:-1]))
            bar.update(1)
            for i, pos in enumerate(range(0, context - 1, base_kv.block_size)):   # in slices: float64 of [T, V]
                rows = slice(pos, pos + base_kv.block_size)
                logp = torch.log_softmax(logits[rows].double(), -1)[keep[rows]]
                v.nll -= logp.gather(-1, targets[rows][keep[rows], None].to(logp.device)).sum().item()
                if v is all_variants[0]:
                    base_logp.append(logp)
                else:
                    v.kl += (base_logp[i].exp() * (base_logp[i] - logp)).sum().item()
        scored += int(keep.sum())
    bar.close()
    return [EvalResult(v.label, dataclasses.asdict(v.kv), math.exp(v.nll / scored), v.kl / scored, scored, context,
                       kv_bytes_per_token(model_cfg, v.kv)) for v in all_variants]


def _teacher_forced_logits(model: LlamaModel, v: _Variant, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of every position, each row reading the cache as plain decoding does at its
    position. The pools hold the whole window in FP16 beside its quantised twins."""
    blocks = BlockManager(v.kv, v.pools.num_fp_blocks, v.pools.num_quant_blocks)
    seq = Sequence(list(ids), SamplingParams(temperature=0), make_generator(SamplingParams(), 0))
    blocks.grow(seq, len(ids))
    # from position 0 every twin is of a block this forward writes: all quantised layer by layer
    views, _, quantise = blocks.row_views(seq, len(ids))
    bs = v.kv.block_size
    # Each run in block-sized slices: the rows of a slice go through attention together, as decode's
    # prefill chunks of one block would, so the sums round alike for any variant.
    # a hybrid model's sliding layers hold the whole window in FP16 (the kernels read only each row's window)
    sliding = list(range(v.pools.sliding.num_fp_blocks)) if v.pools.sliding is not None else None
    inputs = [SeqInput(torch.tensor(ids[pos:min(pos + bs - pos % bs, row + rows)]), pos, table, all_logits=True,
                       sliding_table=sliding) for row, rows, table in views for pos in _slice_starts(row, row + rows, bs)]
    return torch.cat(model.forward(inputs, v.pools, quantise))


def _slice_starts(start: int, stop: int, block_size: int) -> list[int]:
    """start, then every multiple of block_size in (start, stop)."""
    return [start] + list(range((start // block_size + 1) * block_size, stop, block_size))
