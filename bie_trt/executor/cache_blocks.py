"""A prompt's cached KV blocks copied out of the live cache (either tier) and adopted back into it: what a
cache file carries from one run of an engine to another. Both run on the engine's loop thread, between
steps."""
from __future__ import annotations

import dataclasses

import torch

from ..sampling import make_generator
from ..sampling_params import SamplingParams
from ..cache_tiers.block_manager import BlockManager
from ..cache_tiers.cache_file import CachedBlock, CacheFileError
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


def cache_identity(runner: ModelRunner) -> dict:
    """What a cache file must match to be restored here: the engine (its manifest's digest) and the KV
    layout this run stores blocks in (the format, and the activation dtype of its FP16 blocks)."""
    return {"engine": runner.manifest_digest,
            "kv_layout": {**dataclasses.asdict(runner.kv_config),
                          "fp16_block_dtype": str(runner.pools.k.dtype).removeprefix("torch.")}}


def check_groups(blocks: BlockManager) -> None:
    """Cache files carry one cache group: a hybrid model's sliding-window layers and linear-attention layers'
    state snapshots are refused by name."""
    if blocks.sliding is not None:
        raise CacheFileError("cache files do not carry the sliding-window layers' blocks of a hybrid model "
                             "(Gemma 3); its prefix cache keeps a returning prompt on the device instead.")
    if blocks.snapshots is not None:
        raise CacheFileError("cache files do not carry the linear-attention layers' state snapshots (Qwen3.5); "
                             "its prefix cache keeps a returning prompt on the device instead.")


def copy_out(blocks: BlockManager, runner: ModelRunner, scheduler: Scheduler, ids: list[int]) -> list[CachedBlock]:
    """Copies of the blocks a request for `ids` would hit, from either tier."""
    check_groups(blocks)
    seq = Sequence(ids, SamplingParams(), make_generator(SamplingParams(), 0))
    # the last step's compactions may have indexed twins their quantisations have not filled yet
    runner.launch_moves(scheduler.take_moves())
    if runner.device.type == "cuda":   # host-tier copies are asynchronous
        torch.cuda.synchronize(runner.device)
    out = []
    for item in blocks.match(seq):
        if isinstance(item, bytes):
            slot, quantised = blocks.host.blocks[item]
            k, v = runner.host_pool.slots[slot]
            key = item
        else:
            k, v = runner.host_pool.read(item)
            quantised, key = item < 0, blocks.cache.key_of[item]
        out.append(CachedBlock(key, quantised, k.clone(), v.clone()))
    return out


def adopt(blocks: BlockManager, runner: ModelRunner, scheduler: Scheduler, cached: list[CachedBlock]) -> int:
    """The blocks into the device cache, last first (so the LRU keeps a prefix's start longest); each copy
    is launched at once, in order with the moves queued before it. -> blocks taken."""
    check_groups(blocks)
    taken = 0
    for block in reversed(cached):
        slot = blocks.new_slot()
        runner.host_pool.put(slot, block.k, block.v)
        if blocks.adopt(block.key, block.quantised, slot):
            taken += 1
        else:
            runner.host_pool.drop(slot)
    runner.launch_moves(scheduler.take_moves())
    return taken
