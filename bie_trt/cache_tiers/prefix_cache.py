"""The prefix cache's index: full KV blocks found by a key that chains their prefix.

A block's key hashes its parent block's key and its own token ids, so equal keys mean equal
tokens at equal positions, hence equal K/V. Reference counts and free lists live in the block
manager; this index only knows which block-table entry (FP16 or quantised, see pool.py) holds
each key, and which of those no sequence holds any more (an LRU, evicted oldest first). A block's
quantised twin has a key of its own (`quant_key`), so both copies can be found.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_key(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The key of a full block. A cryptographic hash, because a collision would silently serve another
    prompt's K/V."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def quant_key(key: bytes) -> bytes:
    """The key a block's quantised twin is cached under, beside its FP16 copy's `key`."""
    return key + b"q"


class PrefixCache:
    def __init__(self) -> None:
        self.entry_of: dict[bytes, int] = {}   # key -> block-table entry
        self.key_of: dict[int, bytes] = {}     # entry -> key
        # Entries no sequence references, per pool (keyed by "is quantised"), least recently used first.
        self.unused: dict[bool, OrderedDict[int, None]] = {False: OrderedDict(), True: OrderedDict()}

    def get(self, key: bytes) -> int | None:
        return self.entry_of.get(key)

    def add(self, key: bytes, entry: int) -> None:
        """Index `entry` under `key`; the key must be new."""
        self.entry_of[key] = entry
        self.key_of[entry] = key

    def park(self, entry: int) -> bool:
        """The last reference to `entry` went away: keep it findable until evicted. False if it has no key."""
        if entry not in self.key_of:
            return False
        self.unused[entry < 0][entry] = None
        return True

    def unpark(self, entry: int) -> None:
        """A hit on an unreferenced entry: it is in use again, out of eviction's reach."""
        del self.unused[entry < 0][entry]

    def evict(self, quantised: bool) -> int | None:
        """The least recently used unreferenced entry of one pool, forgotten; None if there is none."""
        oldest = self.evict_keyed(quantised)
        return None if oldest is None else oldest[0]

    def evict_keyed(self, quantised: bool) -> tuple[int, bytes] | None:
        """`evict`, with the key the entry was found by."""
        if not self.unused[quantised]:
            return None
        entry, _ = self.unused[quantised].popitem(last=False)
        key = self.key_of.pop(entry)
        del self.entry_of[key]
        return entry, key

    def num_unused(self, quantised: bool) -> int:
        return len(self.unused[quantised])


def share(ref_counts: dict[int, int], cache: PrefixCache | None, block: int) -> None:
    """One more holder of `block`; a cached block nobody held leaves the LRU."""
    if block in ref_counts:
        ref_counts[block] += 1
    else:
        cache.unpark(block)
        ref_counts[block] = 1


def release(ref_counts: dict[int, int], cache: PrefixCache | None, block: int) -> bool:
    """One holder fewer; True when `block` is free: nobody holds it and the cache did not keep it in its LRU."""
    ref_counts[block] -= 1
    if ref_counts[block]:
        return False
    del ref_counts[block]
    return cache is None or not cache.park(block)
