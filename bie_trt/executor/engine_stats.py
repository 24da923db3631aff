"""A core's counters and pools at one moment, as `EngineStats` (what /metrics exports)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.cuda_graphs import STEP_KINDS
from .outputs import EngineStats

if TYPE_CHECKING:
    from .engine_core import EngineCore


def engine_stats(core: "EngineCore") -> EngineStats:
    """Read from any thread without stopping the loop: each number is read atomically, so a snapshot may
    straddle one step."""
    s, blocks = core.scheduler, core.blocks
    pools = {"fp16": blocks.usage(False)}
    if blocks.quantised:
        pools["quant"] = blocks.usage(True)
    if blocks.sliding is not None:   # a hybrid model's sliding-window layers, apart
        pools["sliding"] = blocks.sliding.usage()
    return EngineStats(dict(core.finished), core.prompt_tokens, core.generation_tokens, s.num_preemptions,
                       s.prefix_queried_tokens, s.prefix_hit_tokens, pools, len(s.running), len(s.waiting),
                       core.spec.stats(), _host(core), _graphs(core), _disk(core))


def _graphs(core: "EngineCore") -> dict[str, dict[str, int]]:
    graphs = core.runner.graphs
    return {kind: dict(graphs.counts[kind]) if graphs is not None else {"graph": 0, "eager": 0}
            for kind in STEP_KINDS}


def _disk(core: "EngineCore") -> dict[str, int]:
    if core.disk is None:
        return {}
    stats = core.disk.stats()
    bs = core.blocks.block_size
    return {**stats, "hit_tokens": stats.pop("hit_blocks") * bs, "missed_tokens": stats.pop("missed_blocks") * bs}


def _host(core: "EngineCore") -> dict[str, float]:
    host, pool = core.blocks.host, core.runner.host_pool
    on = host is not None   # (an empty tier is falsy: it has a length)
    return {"capacity_bytes": host.capacity if on else 0, "used_bytes": host.held if on else 0,
            "blocks": len(host) if on else 0, "hit_tokens": core.scheduler.host_hit_tokens,
            "offloaded_bytes": pool.bytes_offloaded, "restored_bytes": pool.bytes_restored,
            "offload_seconds": pool.seconds_offloading, "restore_seconds": pool.seconds_restoring}
