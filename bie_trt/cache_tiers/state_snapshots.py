"""The recurrent cache group's part of the prefix cache: linear-attention states saved at block boundaries.

A KV prefix hit lets a returning prompt skip its cached tokens, but a linear-attention layer (Qwen3.5's Gated
DeltaNet) keeps no per-token cache to read them from: it needs its state as it was right after them. So a
prompt's prefill saves the state at chosen block boundaries into snapshot slots (kv/recurrent.py), each found
by the prefix-cache key of the block that ends at its boundary (prefix_cache.block_key chains every token
before it), and a hit stops at the last boundary that has one.

Which boundaries: the prompt's last full block boundary before its last token (where a hit on the same prompt
stops: the last token is always recomputed), and with an `interval`, every multiple of it below that (a longer
prompt that starts with this one, an agent's next turn, resumes from one of them). Slots are few (a state is
tens of MiB for a 9B model), so the least recently used snapshot is overwritten first.

Host bookkeeping only: the model writes a reserved slot during the step (SeqInput.save_states), and the
snapshot is findable only once that step ran (`commit`), so that a hit never reads a slot not yet written.
"""
from __future__ import annotations

from collections import OrderedDict

from ..executor.sequence import Sequence

Save = tuple[int, int]   # (the position after which the state is saved, its snapshot slot)


def save_positions(start: int, num_tokens: int, prompt_len: int, block_size: int, interval: int) -> list[int]:
    """Boundaries p in (start, start + num_tokens] at which a prefill chunk saves the state: the prompt's last
    full block boundary before its last token, and multiples of `interval` (0: none) below it."""
    last = (prompt_len - 1) // block_size * block_size
    return [p for p in range(start + 1, min(start + num_tokens, last) + 1)
            if p % block_size == 0 and (p == last or (interval and p % interval == 0))]


class StateSnapshots:
    def __init__(self, slots: list[int], interval: int = 0):
        self.interval = interval
        self.free = list(slots)
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()   # key -> slot, least recently used first
        self.pending: dict[Sequence, list[tuple[int, bytes, int]]] = {}   # seq -> (position, key, slot) to commit

    def __len__(self) -> int:
        return len(self.slot_of)

    def has(self, key: bytes) -> bool:
        return key in self.slot_of

    def take(self, key: bytes) -> int:
        """The slot of the snapshot saved under `key`, now the most recently used."""
        self.slot_of.move_to_end(key)
        return self.slot_of[key]

    def reserve(self, seq: Sequence, position: int, key: bytes) -> int | None:
        """A slot for seq's state after `position` tokens (the block ending there keyed `key`), or None when a
        snapshot of it is saved or reserved already, or no slot can be had (all reserved this step)."""
        if key in self.slot_of or any(k == key for saves in self.pending.values() for _, k, _ in saves):
            return None
        if self.free:
            slot = self.free.pop()
        elif self.slot_of:
            _, slot = self.slot_of.popitem(last=False)
        else:
            return None
        self.pending.setdefault(seq, []).append((position, key, slot))
        return slot

    def commit(self, seq: Sequence) -> None:
        """seq's step ran: its saves up to its cached tokens are written, so findable."""
        saves = self.pending.pop(seq, [])
        for position, key, slot in saves:
            if position <= seq.num_cached:
                self.slot_of[key] = slot
            else:   # not reached (a failed step): the slot was never written
                self.free.append(slot)

    def cancel(self, seq: Sequence) -> None:
        """seq was freed before its saves ran (preempted or aborted in the step that reserved them)."""
        self.free += [slot for _, _, slot in self.pending.pop(seq, [])]

    def clear(self) -> None:
        """Forget every saved snapshot (reserved ones stay, their steps still write them)."""
        self.free += self.slot_of.values()
        self.slot_of.clear()
