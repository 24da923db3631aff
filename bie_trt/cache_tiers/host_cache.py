"""The host tier of the prefix cache: blocks the device evicted wait here, by the same key, until a hit
copies them back or room for newer ones pushes them out for good.

Pure bookkeeping, like the device index: a block lives in host memory under a slot number the model
runner's host pool (kv/host_pool.py) stores its bytes under. The tier is bounded in bytes, and a slot
is never reused, so a batch's moves (offloads, restores, drops in the order decided) never confuse
two blocks. A block taken for a restore stays counted until that restore has run: the bound holds
for the memory the runner really holds.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Offload:
    """Copy device block-table `entry` into host `slot` (before anything reuses the device block)."""
    entry: int
    slot: int


@dataclass(frozen=True)
class Restore:
    """Copy host `slot` into device block-table `entry`, then free the slot."""
    slot: int
    entry: int


@dataclass(frozen=True)
class Drop:
    """Free host `slot` for good (evicted from the host tier)."""
    slot: int


HostMove = Offload | Restore | Drop


class HostCache:
    def __init__(self, capacity_bytes: int, block_bytes: dict[bool, int], slots: Iterator[int]):
        self.capacity = capacity_bytes
        self.block_bytes = block_bytes          # is quantised -> bytes of one block (every layer, K and V)
        # key -> (slot, is quantised), least recently evicted from the device first
        self.blocks: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()
        self.used = 0                           # bytes of the blocks in `blocks`
        self.tail: set[bytes] = set()           # keys of FP16 blocks stored for being near a prompt's end
        self.in_flight = 0                      # bytes of blocks taken for restores not launched yet
        self._slots = slots                     # the block manager's: never reused
        self.num_offloaded = self.num_restored = self.num_dropped = 0

    @property
    def held(self) -> int:
        """Bytes the runner's host pool holds: never above `capacity`."""
        return self.used + self.in_flight

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def put(self, key: bytes, quantised: bool, moves: list[HostMove], tail: bool = False) -> int | None:
        """Make room (dropping the least recently stored blocks, listed in `moves`) and a slot for a block
        the device evicts; None when one block is larger than the whole tier or the key is stored already."""
        size = self.block_bytes[quantised]
        if size > self.capacity - self.in_flight or key in self.blocks:
            return None
        while self.held + size > self.capacity:
            self._drop_oldest(moves)
        slot = next(self._slots)
        self.blocks[key] = (slot, quantised)
        if tail:
            self.tail.add(key)
        self.used += size
        self.num_offloaded += 1
        return slot

    def _drop_oldest(self, moves: list[HostMove]) -> None:
        key, (slot, quantised) = self.blocks.popitem(last=False)
        self.tail.discard(key)
        self.used -= self.block_bytes[quantised]
        self.num_dropped += 1
        moves.append(Drop(slot))

    def take(self, key: bytes) -> tuple[int, bool, bool]:
        """A hit: the block leaves the tier for the device. -> (slot, is quantised, stored as a tail block).
        Its bytes count until `settle` (the restore has been handed to the runner)."""
        slot, quantised = self.blocks.pop(key)
        tail = key in self.tail
        self.tail.discard(key)
        size = self.block_bytes[quantised]
        self.used -= size
        self.in_flight += size
        self.num_restored += 1
        return slot, quantised, tail

    def settle(self) -> None:
        """The restores decided so far are in the runner's hands, which frees their slots as it copies them."""
        self.in_flight = 0

    def discard(self, key: bytes, moves: list[HostMove]) -> None:
        """Forget `key`'s block if the tier has it (listed in `moves`)."""
        if key in self.blocks:
            self.blocks.move_to_end(key, last=False)
            self._drop_oldest(moves)

    def clear(self, moves: list[HostMove]) -> None:
        while self.blocks:
            self._drop_oldest(moves)
