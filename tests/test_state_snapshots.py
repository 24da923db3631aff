"""The recurrent group's prefix cache: which boundaries a prompt saves, the snapshot slots' bookkeeping, a
prefix hit cut to the last boundary with a saved state, and a state saved mid-chunk equal to the state of a
prefill that stops there."""
from __future__ import annotations

import torch

from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.cache_tiers.state_snapshots import StateSnapshots, save_positions
from bie_trt.config import KVCacheConfig
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels.step_inputs import SeqInput
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams


def seq(ids: list[int]) -> Sequence:
    return Sequence(ids, SamplingParams(), make_generator(SamplingParams(), 0))


def test_a_prompt_saves_its_last_boundary_and_every_interval_below_it():
    # 100 tokens, blocks of 16: the last token is recomputed, so the hit ends at 96
    assert save_positions(0, 100, 100, 16, 0) == [96]
    assert save_positions(0, 48, 100, 16, 0) == []           # a chunk before it saves nothing
    assert save_positions(48, 52, 100, 16, 32) == [64, 96]   # the interval's multiples in the chunk, and the end
    assert save_positions(96, 4, 100, 16, 32) == []          # already past it
    assert save_positions(0, 97, 97, 16, 0) == [96]          # a boundary right before the last token


def test_a_snapshot_is_found_only_once_its_step_ran_and_the_oldest_is_overwritten():
    snaps, a, b, c = StateSnapshots([5, 6]), seq([1] * 40), seq([2] * 40), seq([3] * 40)
    slot = snaps.reserve(a, 32, b"ka")
    assert slot is not None and not snaps.has(b"ka")
    assert snaps.reserve(b, 32, b"ka") is None               # reserved once
    a.num_cached = 40
    snaps.commit(a)
    assert snaps.has(b"ka") and snaps.take(b"ka") == slot
    other = snaps.reserve(b, 32, b"kb")
    b.num_cached = 16                                        # its step stopped short of the boundary
    snaps.commit(b)
    assert not snaps.has(b"kb") and other in snaps.free
    assert snaps.reserve(c, 32, b"kc") is not None and snaps.reserve(c, 32, b"kd") == slot   # the LRU one
    assert not snaps.has(b"ka")
    snaps.cancel(c)                                          # preempted before its step: both slots back
    assert sorted(snaps.free) == [5, 6]


def test_a_hit_stops_at_the_last_boundary_with_a_saved_state():
    kv = KVCacheConfig(dtype="fp16")
    blocks = BlockManager(kv, 32, 0, enable_prefix_caching=True, snapshots=StateSnapshots([9]))
    first = seq(list(range(100)))
    blocks.grow(first, 100)
    blocks.commit(first, 100)
    keys = blocks.prompt_keys(first)
    returning = seq(list(range(100)))
    assert blocks.match(returning) == []                     # every KV block cached, no state: no hit
    blocks.snapshots.reserve(first, 48, keys[2])
    blocks.snapshots.commit(first)
    assert len(blocks.match(returning)) == 3                 # 48 tokens: where the state was saved
    assert len(blocks.match(seq(list(range(40)) + [7] * 60))) == 0   # another prompt after 40 tokens


def test_a_state_saved_mid_chunk_is_the_state_of_a_prefill_stopping_there(qwen35_reference):
    from qwen35_tiny import engine_model

    model, pools = engine_model(qwen35_reference[0], slots=3)
    states = pools.recurrent
    ids, table = torch.tensor(qwen35_reference[1][:80]), list(range(8))
    part, whole, snapshot = states.allocate(), states.allocate(), states.allocate()
    model.forward([SeqInput(ids[:48], 0, table, state_slot=part)], pools)
    saved_part = states.snapshot(part)
    model.forward([SeqInput(ids, 0, table, state_slot=whole, save_states=[(48, snapshot)])], pools)
    assert torch.allclose(states.conv[:, snapshot], saved_part.conv, atol=1e-5)
    assert torch.allclose(states.delta[:, snapshot], saved_part.delta, atol=1e-5)
    assert not torch.allclose(states.delta[:, whole], saved_part.delta, atol=1e-3)   # and the prefill went on
