"""Continuous batching (DESIGN §7): which sequences run in the next step, and how many tokens each.

Each step has a token budget. Running decodes go first (latency), then the next chunk of prompts
already under way, then new requests in arrival order while the budget, `max_num_seqs` and the KV
pool allow. A running sequence that cannot grow preempts the most recently admitted one: its
blocks are freed and it waits again, first in line, keeping its generated tokens to recompute.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager, Copy
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    chunks: list[tuple[Sequence, int]]   # each sequence and how many of its pending tokens run
    copies: list[Copy]                   # copy-on-write to carry out before the step


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []    # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0       # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0           # ... and found there

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
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Sequence, tuple[int, list[Copy]]] = {}
        preemptions = self.num_preemptions

        def budget() -> int:
            return self.max_num_batched_tokens - sum(n for n, _ in scheduled.values())

        for seq in sorted(self.running, key=lambda s: s.num_pending > 1):   # decodes, then prompt chunks
            if seq.status is not Status.RUNNING or budget() == 0:   # preempted by an earlier one
                continue
            n = min(seq.num_pending, self.chunk_size, budget())
            if self._make_room(seq, seq.num_cached + n, scheduled):
                scheduled[seq] = (n, self.blocks.grow(seq, seq.num_cached + n))

        # Admitting right after preempting would only thrash: the pool is full.
        while (self.num_preemptions == preemptions and self.waiting and budget() > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = self.blocks.match(seq)
            cached = len(hit) * self.blocks.block_size
            n = min(seq.num_tokens - cached, self.chunk_size, budget())
            if not self.blocks.can_admit(hit, cached + n):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, hit)
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled[seq] = (n, self.blocks.grow(seq, cached + n))

        return ScheduledBatch([(seq, n) for seq, (n, _) in scheduled.items()],
                              [c for _, copies in scheduled.values() for c in copies])

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict) -> bool:
        """Preempt the newest running sequences until `seq` can hold `num_tokens`; False if that meant
        preempting `seq` itself."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running.pop()
            scheduled.pop(victim, None)
            self.blocks.free(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True
