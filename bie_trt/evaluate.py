"""KV-cache quality: perplexity and KL divergence from the FP16-KV run, scored as decode sees them.

Every variant runs over the same windows as an FP16-KV baseline, sharing one copy of the weights.
A window goes through one forward as one sequence whose rows read the cache exactly as plain
decoding does at their positions (the engine's own mechanism, cache_tiers/exact_rows.py): its rows
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
from .cache_tiers.block_manager import BlockManager
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
    such as the source GGUF's own weights (builder/eval_reference.py).

    Memory: a window's forward keeps only each variant's final hidden states [context, H]; the head and the
    float64 softmax run over all variants together a slice of rows at a time (`_score`), so the peak grows
    with the context by the KV pools and the hidden states, not by [context, V]. A `reference` returns its
    logits whole: [context, V] in float32 for that one."""
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
    # a pass per variant, then one over the rows that scores them all (as long as a forward or two at 8k tokens)
    bar = tqdm(total=len(starts) * (len(all_variants) + 1), desc=f"eval ctx {context}", unit="pass",
               disable=not progress)
    for start in starts:
        window = token_ids[start:start + context]
        score_from = 0 if start == 0 else context - stride   # score only tokens no earlier window scored
        first = max(score_from, 1) - 1                        # row r predicts window[r + 1]
        rows_of = []
        for v in all_variants:
            rows_of.append(_reference_rows(reference[1](window[:-1])) if v.pools is None else
                           _head_rows(runner.model, _teacher_forced_hidden(runner.model, v, window[:-1])))
            bar.update(1)
        _score(all_variants, rows_of, torch.tensor(window[1 + first:]), first, model_cfg.vocab_size)
        bar.update(1)
        scored += context - 1 - first
    bar.close()
    return [EvalResult(v.label, dataclasses.asdict(v.kv), math.exp(v.nll / scored), v.kl / scored, scored, context,
                       kv_bytes_per_token(model_cfg, v.kv)) for v in all_variants]


# Rows of logits scored at once: float64 log-probs of a whole window are [T, V] (17 GB for 8,192 tokens of a
# 262,144-token vocabulary), so every variant's rows go through the head and the softmax a slice at a time,
# ~256 MiB of float64 a slice; wide enough that reading the head's weights once a slice costs little.
_SLICE_ELEMENTS = 1 << 25


@torch.inference_mode()
def _score(variants: list[_Variant], rows_of: list[Callable[[slice], torch.Tensor]], targets: torch.Tensor,
           first: int, vocab: int) -> None:
    """Adds each variant's NLL of `targets` (the tokens rows first.. predict) and the baseline's (variants[0])
    KL divergence to it, slice by slice, in float64."""
    step = max(1, _SLICE_ELEMENTS // vocab)
    for lo in range(0, len(targets), step):
        rows, want = slice(first + lo, first + lo + step), targets[lo:lo + step, None]
        base = None
        for v, logits in zip(variants, rows_of):
            logp = torch.log_softmax(logits(rows).double(), -1)
            v.nll -= logp.gather(-1, want.to(logp.device)).sum().item()
            if base is None:
                base, base_p = logp, logp.exp()
            else:
                v.kl += (base_p * (base - logp)).sum().item()


def _reference_rows(logits: torch.Tensor) -> Callable[[slice], torch.Tensor]:
    return lambda rows: logits[rows]


def _head_rows(model: LlamaModel, hidden: torch.Tensor) -> Callable[[slice], torch.Tensor]:
    """The model's own head (final norm, LM head, soft-capping) over the rows of a slice only."""
    return lambda rows: model.head_logits(hidden[rows]).float()


def _teacher_forced_hidden(model: LlamaModel, v: _Variant, ids: list[int]) -> torch.Tensor:
    """Final hidden states [len(ids), H] of every position (before the final norm), each row reading the cache
    as plain decoding does at its position. The pools hold the whole window in FP16 beside its quantised twins."""
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
    return model.final_hidden(inputs, v.pools, quantise)


def _slice_starts(start: int, stop: int, block_size: int) -> list[int]:
    """start, then every multiple of block_size in (start, stop)."""
    return [start] + list(range((start // block_size + 1) * block_size, stop, block_size))
