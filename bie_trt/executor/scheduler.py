"""Continuous batching: which sequences run in the next step and how many tokens each, and each
sequence's bookkeeping once the step ran.

Each step has a token budget. Running decodes go first (latency), then the next chunk of prompts
already under way, then new requests in arrival order while the budget, `max_num_seqs` and the KV
pool allow. A running sequence that cannot grow preempts the most recently admitted one: its
blocks are freed and it waits again, first in line, keeping its generated tokens to recompute.

With speculative decoding a decode may also reserve room for proposals (lookahead): only once
every running sequence is scheduled, from the budget and blocks left over, so speculation never
preempts.

After the step, `postprocess` counts each sequence's computed tokens, gives back the blocks held for
rejected proposals and compacts what left the window; the quantisations that decides are launched at
the start of the next step, with its copies. They travel with the host tier's offloads, restores and
drops in one list (`moves`), in the order the block manager decided them: a block offloaded is read
before a later quantisation or restore reuses it, and a quantisation's FP16 block before a restore
overwrites it.

A model with linear-attention layers: each running sequence holds a recurrent state slot. A prefix hit restores
the state saved at the hit's end into it; a prompt chunk that crosses a boundary worth a snapshot
(state_snapshots.py) saves the state there during the step (`ScheduledBatch.saves`), findable once the step ran.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..config import KVCacheConfig
from ..errors import EngineError
from ..kv.recurrent import RecurrentStates
from ..kv.sizing import bounded_fp_blocks_per_seq
from ..plan import step_tokens
from ..cache_tiers.block_manager import BlockManager, Copy, Quantisation, View
from ..cache_tiers.host_cache import HostMove
from ..cache_tiers.state_snapshots import Save, save_positions
from .sequence import Sequence, Status

Move = Quantisation | HostMove   # a block move launched before a step's copies and forward


@dataclass
class ScheduledBatch:
    chunks: list[tuple[Sequence, int]]   # each sequence and how many of its pending tokens run
    copies: list[Copy]                   # copy-on-write to carry out before the step
    moves: list[Move] = field(default_factory=list)   # to carry out first, in order (see the module docstring)
    # decodes with room for proposals: how many tokens may follow the pending one (blocks held for them)
    lookahead: dict[Sequence, int] = field(default_factory=dict)
    # each chunk's rows (and room for proposals) in runs that read the same blocks quantised (cut_rows);
    # a chunk without an entry is one run over its own table
    views: dict[Sequence, list[View]] = field(default_factory=dict)
    layer_quantisations: list[Quantisation] = field(default_factory=list)   # blocks the step writes, then reads quantised
    saves: dict[Sequence, list[Save]] = field(default_factory=dict)   # recurrent states to save during the step


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill_size: int,
                 num_speculative_tokens: int = 0, max_model_len: int | None = None,
                 on_free: Callable[[Sequence], None] | None = None,
                 gamma_for: Callable[[Sequence], int] | None = None, states: RecurrentStates | None = None):
        self.blocks = blocks
        # A model with linear-attention layers: a running sequence holds one of these state slots, taken at
        # admission and given back with its blocks (a preempted one recomputes its state from the first token).
        self.states = states
        self.num_speculative_tokens = num_speculative_tokens   # proposals per decode step (0: no speculation)
        self.gamma_for = gamma_for           # a decode's proposals this step, at most the above (None: all of them)
        self.max_model_len = max_model_len
        self.on_free = on_free               # a sequence's blocks went (finished, aborted, preempted)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []    # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0       # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0           # ... and found there
        self.host_hit_tokens = 0             # ... of those, restored from the host tier
        self._moves: list[Move] = []         # decided since the last schedule

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished, or aborted by its consumer) and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if self.blocks.snapshots is not None:
            self.blocks.snapshots.cancel(seq)
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
        if self.on_free:
            self.on_free(seq)

    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Sequence, tuple[int, list[Copy]]] = {}
        lookahead: dict[Sequence, int] = {}
        preemptions = self.num_preemptions

        def budget() -> int:
            return (self.max_num_batched_tokens - sum(n for n, _ in scheduled.values())
                    - sum(k for s, k in lookahead.items() if s in scheduled))

        def run(seqs: list[Sequence]) -> None:
            for seq in seqs:
                if seq.status is not Status.RUNNING or budget() == 0:   # preempted by an earlier one
                    continue
                n = min(seq.num_pending, self.chunked_prefill_size, budget())
                if self._make_room(seq, seq.num_cached + n, scheduled):
                    scheduled[seq] = (n, self.blocks.grow(seq, seq.num_cached + n))

        run([s for s in self.running if s.num_pending == 1])   # decodes first (latency)
        run([s for s in self.running if s.num_pending > 1])    # then the prompt chunks under way
        if self.num_speculative_tokens:   # then proposals, from what is left: speculation never preempts
            self._reserve_lookahead(scheduled, lookahead, budget)

        # Admitting right after preempting would only thrash: the pool is full.
        while (self.num_preemptions == preemptions and self.waiting and budget() > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = self.blocks.match(seq)
            cached = len(hit) * self.blocks.block_size
            from_host = sum(isinstance(item, bytes) for item in hit) * self.blocks.block_size
            n = min(seq.num_tokens - cached, self.chunked_prefill_size, budget())
            if not self.blocks.can_admit(hit, cached + n, seq):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, hit)
            if self.states is not None:
                seq.state_slot = self.states.allocate()
                if hit:   # the linear-attention layers resume from their state saved at the hit's end
                    key = self.blocks.prompt_keys(seq)[len(hit) - 1]
                    self.states.copy(self.blocks.snapshots.take(key), seq.state_slot)
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += cached
            self.host_hit_tokens += from_host
            if seq.num_prompt_cached is None:
                seq.num_prompt_cached = min(cached, len(seq.prompt_ids))
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled[seq] = (n, self.blocks.grow(seq, cached + n))

        for seq in scheduled:   # a prefix hit can bring FP16 blocks already out of seq's window
            self._add_moves(self.blocks.compact(seq))
        return self.batch([(seq, n) for seq, (n, _) in scheduled.items()],
                          [c for _, copies in scheduled.values() for c in copies],
                          {s: k for s, k in lookahead.items() if s in scheduled})

    def batch(self, chunks: list[tuple[Sequence, int]], copies: list[Copy],
              lookahead: dict[Sequence, int]) -> ScheduledBatch:
        """The step over `chunks` (blocks already grown): its rows cut into views, with the quantisations
        decided since the last step."""
        views, layer_quantisations = self.cut_rows(chunks, lookahead)
        return ScheduledBatch(chunks, copies, self.take_moves(), lookahead, views, layer_quantisations,
                              self._saves(chunks))

    def _saves(self, chunks: list[tuple[Sequence, int]]) -> dict[Sequence, list[Save]]:
        """The recurrent states each prompt chunk saves at the boundaries it crosses (state_snapshots.py)."""
        snapshots, saves = self.blocks.snapshots, {}
        if snapshots is None:
            return saves
        for seq, n in chunks:
            positions = save_positions(seq.num_cached, n, len(seq.prompt_ids), self.blocks.block_size,
                                       snapshots.interval)
            keys = self.blocks.prompt_keys(seq) if positions else []
            for p in positions:
                slot = snapshots.reserve(seq, p, keys[p // self.blocks.block_size - 1])
                if slot is not None:
                    saves.setdefault(seq, []).append((p, slot))
        return saves

    def cut_rows(self, chunks: list[tuple[Sequence, int]], lookahead: dict[Sequence, int]
                 ) -> tuple[dict[Sequence, list[View]], list[Quantisation]]:
        """Each chunk's rows (with the room kept for proposals) in runs that read the KV blocks as plain
        decoding did at their positions (`BlockManager.row_views`). Twins of blocks full before the step
        join the quantisations it launches first; those of blocks it writes come back, for the forward to
        quantise layer by layer."""
        views, layer_quantisations = {}, []
        for seq, n in chunks:
            views[seq], now, per_layer = self.blocks.row_views(seq, n + lookahead.get(seq, 0))
            self._add_moves(now)
            layer_quantisations += per_layer
        return views, layer_quantisations

    def _add_moves(self, quantisations: list[Quantisation]) -> None:
        """Queue quantisations a block-manager call returned, after the host moves decided before them
        (inside that call: the evictions that freed their quantised blocks)."""
        self._moves += self.blocks.take_host_moves()
        self._moves += quantisations

    def take_moves(self) -> list[Move]:
        """The block moves decided since the last call, in order, for the next step to launch first."""
        self._add_moves([])
        moves, self._moves = self._moves, []
        if self.blocks.host is not None:   # the runner frees the restored slots as it launches these
            self.blocks.host.settle()
        return moves

    def postprocess(self, seq: Sequence, num_computed: int, had_lookahead: bool) -> None:
        """The step wrote K/V for seq's next `num_computed` tokens: count them (indexing full blocks for the
        prefix cache), free the blocks held for proposals past them, and compact what left the window."""
        self.blocks.commit(seq, num_computed)
        if self.blocks.snapshots is not None:
            self.blocks.snapshots.commit(seq)
        if had_lookahead:
            self.blocks.truncate(seq)
        self._add_moves(self.blocks.compact(seq))

    def _reserve_lookahead(self, scheduled: dict, lookahead: dict[Sequence, int], budget: Callable[[], int]) -> None:
        """Room for proposals after each scheduled decode's token, as many as it can still use (max_tokens,
        max_model_len), the step's budget and the free blocks allow. Only decodes of generated tokens
        speculate: a prompt's last token is a prompt chunk, which proposals never join."""
        for seq, (n, copies) in scheduled.items():
            if n != 1 or seq.num_pending != 1 or not seq.output_ids:
                continue
            k = min(self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_ids) - 1, budget())
            if self.max_model_len is not None:
                k = min(k, self.max_model_len - seq.num_tokens - 1)
            if k > 0 and self.gamma_for is not None:   # asked only where proposals fit at all
                k = min(k, self.gamma_for(seq))
            while k > 0 and not self.blocks.can_grow(seq, seq.num_cached + 1 + k):
                k -= 1
            if k > 0:
                copies += self.blocks.grow(seq, seq.num_cached + 1 + k)
                lookahead[seq] = k

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict) -> bool:
        """Preempt the newest running sequences until `seq` can hold `num_tokens`; False if that meant
        preempting `seq` itself."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running.pop()
            scheduled.pop(victim, None)
            self._free(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True


def step_budget(planned: int, wanted: int | None, chunked_prefill_size: int, max_num_seqs: int,
                num_speculative_tokens: int) -> int:
    """Tokens a step may run (`max_num_batched_tokens`): `wanted`, else a prefill chunk beside every decode
    and its proposals, which is the plan's step when the engine speculates as it was built to; never more
    than the `planned` step the plan holds activations for (speculation asked of an engine built without it
    takes only what a prefill chunk leaves)."""
    if wanted is None:
        return min(step_tokens(chunked_prefill_size, max_num_seqs, num_speculative_tokens), planned)
    if wanted > planned:
        raise EngineError(f"max_num_batched_tokens {wanted} is above the {planned} tokens a step of this engine "
                          f"holds activations for in its memory plan; lower it (or leave it unset), or rebuild "
                          f"with a larger --chunked-prefill-size.")
    return wanted


def check_progress(kv: KVCacheConfig, max_model_len: int, chunked_prefill_size: int, num_fp_blocks: int,
                   budget: int, max_num_seqs: int, num_speculative_tokens: int) -> None:
    """The scheduler relies on one sequence always fitting the pool alone, and on a step's budget holding a
    decode of every running sequence, so that it always makes progress: refuse settings that break either."""
    per_seq = -(-max_model_len // kv.block_size)
    if kv.dtype != "fp16":
        per_seq = min(per_seq, bounded_fp_blocks_per_seq(kv, kv.window, chunked_prefill_size))
    if num_fp_blocks < per_seq:
        raise EngineError(f"the FP16 KV pool has {num_fp_blocks} blocks but one sequence of max_model_len "
                          f"{max_model_len} needs {per_seq}; raise num_kv_blocks or lower max_model_len.")
    if budget < max_num_seqs:
        raise EngineError(f"max_num_batched_tokens {budget} is below max_num_seqs {max_num_seqs}; every running "
                          f"sequence must be able to decode in each step.")
    # Verified tokens must stay FP16 until accepted: a block is quantised only once its tokens are final.
    if num_speculative_tokens and kv.dtype != "fp16" and kv.window < num_speculative_tokens + 1:
        raise EngineError(f"the KV window of {kv.window} tokens is smaller than the {num_speculative_tokens + 1} "
                          f"tokens a speculative step verifies; lower num_speculative_tokens to "
                          f"{max(kv.window - 1, 0)} or less (0: off), or build with a larger --kv-window.")
