"""The engine's side of the disk tier (disk_cache.py), on the loop thread between steps: a prompt's blocks
handed to the writer once it is prefilled, and a new prompt's blocks that only the disk holds read back
into the prefix cache before it is scheduled."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import EngineConfig
from ..errors import EngineError
from ..sampling import make_generator
from ..sampling_params import SamplingParams
from ..cache_tiers.block_manager import BlockManager
from .cache_blocks import adopt, cache_identity
from ..cache_tiers.cache_file import CachedBlock
from ..cache_tiers.disk_cache import DiskTier, PendingBlock, disk_bytes
from .model_runner import ModelRunner
from ..cache_tiers.prefix_cache import quant_key
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


def open_disk_tier(config: EngineConfig, runner: ModelRunner, model_name: str) -> DiskTier | None:
    """The tier `config` asks for: `kv_cache_dir` set, `disk_kv_cache_gb` not 0, prefix caching on. None for a
    hybrid model: its files would lack the sliding layers' blocks or the linear-attention layers' state snapshots
    that a hit needs (logged once)."""
    if config.kv_cache_dir is None or not runner.prefix_caching(config.enable_prefix_caching):
        return None
    if runner.pools.sliding is not None:
        log.warning("disk KV tier off: it does not keep the sliding-window layers' blocks of a hybrid model")
        return None
    if runner.pools.recurrent is not None:
        log.warning("disk KV tier off: it does not keep the linear-attention layers' state snapshots a hit on "
                    "this model resumes from")
        return None
    root = Path(config.kv_cache_dir).expanduser()
    try:
        capacity = disk_bytes(config.disk_kv_cache_gb, root)
    except ValueError as e:
        raise EngineError(str(e)) from None
    if capacity == 0:
        return None
    return DiskTier(root, cache_identity(runner), capacity, {"model": model_name})


def persist_prompt(blocks: BlockManager, runner: ModelRunner, scheduler: Scheduler, disk: DiskTier,
                   seq: Sequence) -> None:
    """Hand the writer the blocks a resend of seq's prompt would hit (as `BlockManager.match` picks them: the
    quantised body, FP16 sinks and window) that the disk lacks. Call once the prompt is prefilled."""
    probe = Sequence(seq.prompt_ids, SamplingParams(), make_generator(SamplingParams(), 0))
    probe.block_keys = list(seq.block_keys)
    runner.launch_moves(scheduler.take_moves())   # twins indexed by this step's compactions are filled first
    bs, pending = blocks.block_size, []
    for b, item in enumerate(blocks.match(probe)):
        if isinstance(item, bytes):   # in the host tier: its copy there is never written again
            key = item
            slot, quantised = blocks.host.blocks[item]
            k, v = runner.host_pool.slots[slot]
        else:
            key, quantised = blocks.cache.key_of[item], item < 0
            if key in disk:
                continue
            k, v = runner.host_pool.snapshot(item)
        pending.append(PendingBlock(key, quantised, seq.prompt_ids[b * bs:(b + 1) * bs], k, v))
    ready = None
    if pending and runner.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        ready = event.synchronize
    disk.write(pending, ready)


def load_from_disk(blocks: BlockManager, runner: ModelRunner, scheduler: Scheduler, disk: DiskTier,
                   seq: Sequence) -> None:
    """Read seq's leading blocks that only the disk holds into the prefix cache, so its admission hits them
    (as a cache file's are adopted). Stops at the first block no tier holds, or whose file is refused."""
    found: list[CachedBlock] = []
    num_keys = len(keys := blocks.prompt_keys(seq))
    for b, key in enumerate(keys):
        names = [key, quant_key(key)] if blocks.quantised else [key]
        held = [name for name in names if blocks.holds(name)]
        read = [block for name in names if name not in held and name in disk
                if (block := disk.read(name)) is not None]
        if not held and not read:
            disk.missed_blocks += num_keys - b
            break
        found += read
        disk.hit_blocks += bool(read)
    if found:
        adopt(blocks, runner, scheduler, found)
