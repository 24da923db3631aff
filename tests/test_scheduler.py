"""The scheduler without a model: token budget, decodes first, chunked prefill, admission against the
pool, preemption of the newest sequence with its tokens kept, and max_num_seqs."""
from __future__ import annotations

import pytest

from bie_trt.config import KVCacheConfig
from bie_trt.errors import EngineError
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.scheduler import Scheduler, check_progress, step_budget
from bie_trt.executor.sequence import Status
from bie_trt.plan import step_tokens
from test_block_manager import new_seq

B = 16


def scheduler(num_blocks: int, max_num_seqs: int = 4, budget: int = 36, chunk: int = 32,
              caching: bool = False) -> Scheduler:
    return Scheduler(BlockManager(KVCacheConfig(block_size=B), num_blocks, 0, caching), max_num_seqs, budget, chunk)


def step(s: Scheduler) -> list[tuple[int, int]]:
    """One step with a stand-in model: the scheduled tokens get cached and every sequence whose tokens are
    all cached samples token 7. Returns (prompt length, tokens run) per scheduled sequence."""
    batch = s.schedule()
    assert sum(n for _, n in batch.chunks) <= s.max_num_batched_tokens
    for seq, n in batch.chunks:
        s.blocks.commit(seq, n)
        if seq.num_pending == 0:
            seq.output_ids.append(7)
    return [(len(seq.prompt_ids), n) for seq, n in batch.chunks]


def test_chunked_prefill_mixes_with_decodes_first():
    s = scheduler(num_blocks=32)
    s.add(new_seq([1] * 10))
    assert step(s) == [(10, 10)]                 # a short prompt runs whole
    s.add(new_seq([2] * 70))
    assert step(s) == [(10, 1), (70, 32)]        # the decode first, then a chunk of the new prompt
    s.add(new_seq([3] * 40))
    assert step(s) == [(10, 1), (70, 32), (40, 3)]   # the budget (36) is spent: only 3 tokens of the third
    assert step(s) == [(10, 1), (70, 6), (40, 29)]
    assert step(s) == [(10, 1), (70, 1), (40, 8)]     # the second prompt is done: it decodes now
    assert step(s) == [(10, 1), (70, 1), (40, 1)]


def test_admission_waits_for_max_num_seqs():
    s = scheduler(num_blocks=8, max_num_seqs=2)
    for tokens in ([1] * 5, [2] * 5, [3] * 5):
        s.add(new_seq(tokens))
    assert step(s) == [(5, 5), (5, 5)] and len(s.waiting) == 1
    s.finish(s.running[0], "stop")
    assert step(s) == [(5, 1), (5, 5)]


def test_admission_waits_until_the_pool_holds_the_first_chunk():
    s = scheduler(num_blocks=3, budget=64)
    first, second = new_seq([1] * 40), new_seq([2] * 40)
    s.add(first)
    s.add(second)
    assert step(s) == [(40, 32)]                  # second's first chunk needs 2 blocks; 1 is free
    assert second.status is Status.WAITING and s.num_preemptions == 0
    s.finish(first, "stop")
    assert step(s) == [(40, 32)] and second.status is Status.RUNNING


def test_a_sequence_that_cannot_grow_preempts_the_newest_which_keeps_its_tokens():
    s = scheduler(num_blocks=4, budget=64)
    old, new = new_seq([1] * 30), new_seq([2] * 30)
    s.add(old)
    s.add(new)
    for _ in range(3):                            # 2 blocks each fill the pool; both decode up to 32 tokens
        assert step(s) in ([(30, 30), (30, 30)], [(30, 1), (30, 1)])
    assert step(s) == [(30, 1)]                   # old needs a third block: new is preempted
    assert s.num_preemptions == 1 and new.status is Status.WAITING and new.block_table == []
    assert new.output_ids == [7, 7, 7] and list(s.waiting) == [new]   # kept, and first in line
    s.finish(old, "length")
    assert step(s) == [(30, 32)]                  # recomputed in chunks: prompt and generated tokens
    assert step(s) == [(30, 1)] and new.output_ids == [7, 7, 7, 7]


def test_the_newest_sequence_preempts_itself():
    s = scheduler(num_blocks=3, budget=64)
    first, second = new_seq([1] * 20), new_seq([2] * 14)
    s.add(first)
    s.add(second)
    for _ in range(3):                            # first holds 2 blocks, second 1 and reaches 16 tokens
        step(s)
    batch = s.schedule()                          # second needs a block: it is the newest, so it yields
    assert [seq for seq, _ in batch.chunks] == [first] and second.status is Status.WAITING
    assert s.num_preemptions == 1


def test_prefix_hits_are_counted():
    s = scheduler(num_blocks=16, caching=True)
    s.add(new_seq(list(range(40))))
    while s.running or s.waiting:
        step(s)
        if s.running and len(s.running[0].output_ids) == 1:
            s.finish(s.running[0], "length")
    s.add(new_seq(list(range(40)) + [99]))
    assert step(s) == [(41, 9)]                   # 2 of its blocks were cached
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (81, 32)


def shared_prefix_computed():
    """A 5-block pool with caching, after a 49-token prompt ran: it holds 4 blocks, 3 of them full and cached."""
    s = scheduler(num_blocks=5, budget=64, caching=True)
    shared = list(range(48))
    first = new_seq(shared + [99])
    s.add(first)
    step(s)
    step(s)
    return s, shared, first


def test_a_prefix_hit_on_cached_blocks_does_not_count_them_as_free():
    s, shared, first = shared_prefix_computed()
    s.finish(first, "length")                     # its 3 full blocks stay cached, nobody holds them
    other = new_seq([1000] * 20)
    s.add(other)
    assert step(s) == [(20, 20)]
    assert s.blocks.usage(False) == {"used": 2, "cached": 3, "free": 0}
    # The hit takes the 3 cached blocks back: no block is left for the 17 new tokens, so it waits
    # (counting the hit blocks as free would admit it and fail to grow).
    late = new_seq(shared + [500] * 17)
    s.add(late)
    assert step(s) == [(20, 1)] and late.status is Status.WAITING
    s.finish(other, "length")
    assert step(s) == [(65, 17)] and late.num_cached == 65
    assert s.prefix_hit_tokens == 48


def test_a_preempted_sequence_is_not_readmitted_in_the_same_step():
    s = scheduler(num_blocks=5, budget=64, chunk=16)
    old, new = new_seq([1] * 40), new_seq([2] * 30)   # together they outgrow the pool while decoding
    s.add(old)
    s.add(new)
    while not old.is_finished:
        before = s.num_preemptions
        batch = s.schedule()
        if s.num_preemptions > before:
            assert new.status is Status.WAITING and [seq for seq, _ in batch.chunks] == [old]
        for seq, n in batch.chunks:
            s.blocks.commit(seq, n)
            if seq.num_pending == 0:
                seq.output_ids.append(7)
        if len(old.output_ids) == 20:
            s.finish(old, "length")
    # every preemption costs the victim a step of waiting; re-admitting at once thrashes (15 here)
    assert 1 <= s.num_preemptions <= 8


def test_a_prefix_hit_on_blocks_another_sequence_holds_costs_no_free_block():
    s, shared, first = shared_prefix_computed()   # first still runs; 1 block is free
    second = new_seq(shared + [98])
    s.add(second)
    assert step(s) == [(49, 1), (49, 1)]          # shares the 3 held blocks, takes the free one
    assert second.block_table[:3] == first.block_table[:3] and s.blocks.usage(False)["free"] == 0


def test_finishing_a_waiting_sequence_drops_it_from_the_queue():
    s = scheduler(num_blocks=8, max_num_seqs=1)
    running, queued = new_seq([1] * 5), new_seq([2] * 5)
    s.add(running)
    s.add(queued)
    assert step(s) == [(5, 5)]
    s.finish(queued, "abort")                     # a client gone before its request started
    assert queued.is_finished and list(s.waiting) == []
    s.finish(running, "stop")
    assert not s.has_work() and s.schedule().chunks == []


def test_a_decode_runs_before_a_prompt_chunk_admitted_earlier():
    s = scheduler(num_blocks=16, budget=20, chunk=16)
    long, short = new_seq([1] * 40), new_seq([2] * 5)
    s.add(long)
    s.add(short)
    assert step(s) == [(40, 16), (5, 4)]          # the short prompt gets what the budget leaves
    assert step(s) == [(5, 1), (40, 16)]          # its last prompt token goes first: one token, like a decode
    assert step(s) == [(5, 1), (40, 8)]           # and then its decodes


def speculating(budget: int, num_speculative_tokens: int) -> tuple[Scheduler, list]:
    """Three sequences decoding (their prompts cached, one token sampled) with room for num_speculative_tokens proposals each,
    and a 100-token prompt waiting."""
    s = Scheduler(BlockManager(KVCacheConfig(block_size=B), 64, 0), 4, budget, 32, num_speculative_tokens)
    decoding = [new_seq([i] * 5) for i in range(3)]
    for seq in decoding:
        s.add(seq)
    step(s)
    s.add(new_seq([9] * 100))
    return s, decoding


def test_proposals_are_charged_to_the_step_budget():
    """A step budget that holds no proposals (speculation the plan did not expect): the prompt chunk gets
    only what the decodes and their proposals leave."""
    s, decoding = speculating(step_tokens(32, 4, 0), num_speculative_tokens=2)
    batch = s.schedule()
    assert batch.lookahead == {seq: 2 for seq in decoding}
    scheduled = sum(n for _, n in batch.chunks) + sum(batch.lookahead.values())
    assert scheduled == s.max_num_batched_tokens == 36   # 3 decodes + 6 proposals + a 27-token chunk


def test_the_planned_step_holds_a_chunk_beside_every_decode_with_all_its_proposals():
    """The memory plan's step (its activation workspace) is sized so that no proposal is ever cut for
    want of budget while a full prompt chunk runs."""
    s, decoding = speculating(step_tokens(32, 4, 3), num_speculative_tokens=3)
    batch = s.schedule()
    assert batch.lookahead == {seq: 3 for seq in decoding}
    assert dict(batch.chunks)[s.running[-1]] == 32
    assert sum(n for _, n in batch.chunks) + sum(batch.lookahead.values()) <= s.max_num_batched_tokens


def test_postprocess_hands_compactions_to_the_next_step():
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=0, window=16, rotation="none", block_size=B)
    s = Scheduler(BlockManager(kv, 16, 16), 4, 64, 64)
    seq = new_seq([1] * 31)
    s.add(seq)
    assert s.schedule().chunks == [(seq, 31)]
    first_block = seq.block_table[0]
    s.postprocess(seq, 31, had_lookahead=False)   # nothing has left the 16-token window yet
    seq.output_ids.append(7)
    assert s.schedule().moves == []
    s.postprocess(seq, 1, had_lookahead=False)    # 32 cached: block 0 (tokens 0..15) has left the window
    assert seq.num_cached == 32 and seq.block_table[0] < 0
    seq.output_ids.append(8)
    assert s.schedule().moves == [(first_block, 0)]   # launched before the step that may reuse the block
    assert s.take_moves() == []


def test_rows_read_blocks_as_plain_decoding_did_at_their_positions():
    """A prompt chunk past the window: its later rows read block 0 quantised, quantised by the forward
    after writing it; a verify row whose position crosses into the next block's boundary gets that
    block's twin before the step (its tokens are final), and compaction then takes the twin over."""
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=0, window=16, rotation="none", block_size=B)
    s = Scheduler(BlockManager(kv, 16, 16), 4, 64, 64, num_speculative_tokens=4)
    seq = new_seq([1] * 47)
    s.add(seq)
    batch = s.schedule()
    first_block, second_block = seq.block_table[:2]
    assert [(row, rows) for row, rows, _ in batch.views[seq]] == [(0, 32), (32, 15)]
    assert batch.views[seq][0][2][0] == first_block and batch.views[seq][1][2][0] < 0
    assert batch.layer_quantisations == [(first_block, 0)] and batch.moves == []
    s.postprocess(seq, 47, had_lookahead=False)
    assert seq.block_table[0] == batch.views[seq][1][2][0]   # the twin the rows read took block 0's place
    seq.output_ids.append(7)
    batch = s.schedule()
    assert batch.lookahead == {seq: 4}
    assert [(row, rows) for row, rows, _ in batch.views[seq]] == [(0, 1), (1, 4)]   # rows 47 | 48..51
    assert batch.moves == [(second_block, 1)] and batch.layer_quantisations == []
    assert len(seq.block_table) == 4                   # room for 48 + 4 tokens
    s.postprocess(seq, 1, had_lookahead=True)         # every proposal rejected: the room goes back
    assert seq.num_cached == 48 and len(seq.block_table) == 3
    assert seq.block_table[1] == batch.views[seq][1][2][1]
    assert s.take_moves() == []


def test_the_default_budget_is_the_planned_step_when_speculating_as_built():
    planned = step_tokens(256, 4, 3)
    assert step_budget(planned, None, 256, 4, 3) == planned
    assert step_budget(planned, None, 256, 4, 0) == step_tokens(256, 4, 0)   # less asked: less taken
    assert step_budget(planned, None, 256, 4, 8) == planned                  # more: cut to the plan's
    assert step_budget(planned, 260, 256, 4, 3) == 260                       # asked for: taken as is
    with pytest.raises(EngineError, match=f"above the {planned} tokens"):
        step_budget(planned, planned + 1, 256, 4, 3)


def test_settings_that_could_stall_the_loop_are_refused():
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=16, window=32, rotation="none", block_size=B)
    need = 1 + 2 + 2 + 1   # sinks, window, a 32-token chunk, one more (plan.bounded_fp_blocks_per_seq)
    check_progress(kv, 4096, 32, need, 8, 4, 3)
    with pytest.raises(EngineError, match=f"has {need - 1} blocks but one sequence .* needs {need}"):
        check_progress(kv, 4096, 32, need - 1, 8, 4, 3)
    with pytest.raises(EngineError, match="max_num_batched_tokens 3 is below max_num_seqs 4"):
        check_progress(kv, 4096, 32, need, 3, 4, 3)
    with pytest.raises(EngineError, match="window of 32 tokens is smaller than the 33"):
        check_progress(kv, 4096, 32, need, 8, 4, 32)
    check_progress(KVCacheConfig(block_size=B), 64, 32, 4, 8, 4, 32)   # an FP16 cache holds any proposal
