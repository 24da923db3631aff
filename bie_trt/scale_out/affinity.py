"""Prefix-affinity scoring, pure: which replica a prompt goes to.

A prompt's leading full KV blocks are keyed exactly as the prefix cache keys them (each block's key
chains its parent's), so two prompts sharing their first k blocks share their first k keys. The router
remembers which replica served each key lately; a prompt goes to the replica holding its deepest
remembered key (its longest cached prefix, most likely still in that replica's cache) when that key
covers at least `MIN_SHARE` of the prompt's hashed blocks, unless that replica has more than `overload`
requests beyond the least-loaded one, in which case the least-loaded replica takes it (an overflow
reroute). A shorter match is a shared header (a chat template's system prompt, say) that every
replica soon holds: following it would pile every new document onto one replica. Those prompts, and
prompts with no remembered key, go to the least-loaded replica, ties broken toward the replica
remembered for the fewest keys, so new documents spread out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from ..cache_tiers.prefix_cache import block_key

MAX_BLOCKS = 256        # leading blocks hashed per prompt (4k tokens): enough to tell documents apart, cheap
MIN_SHARE = 0.5         # of a prompt's hashed blocks a replica must hold for affinity
TABLE_SIZE = 65536      # keys remembered (least recently routed forgotten first)

AFFINITY, OVERFLOW, LEAST_LOADED = "affinity", "overflow", "least_loaded"


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """The prefix cache's keys of the prompt's first full blocks (at most `max_blocks`), shallowest first.
    A partial last block is never cached, so it is never keyed."""
    keys: list[bytes] = []
    parent = None
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = block_key(parent, list(token_ids[start:start + block_size]))
        keys.append(parent)
    return keys


@dataclass
class AffinityTable:
    """key -> the replica that last served a prompt with that key, bounded, least recently routed out first."""
    capacity: int = TABLE_SIZE
    owner: OrderedDict[bytes, Hashable] = field(default_factory=OrderedDict)
    held: dict[Hashable, int] = field(default_factory=dict)   # replica -> keys it owns (kept with `owner`)

    def deepest(self, keys: Sequence[bytes], replicas: set) -> tuple[Hashable | None, int]:
        """The replica (among `replicas`, the live ones) remembered for the deepest of `keys`, and how many
        of `keys` lead up to that one (0: none remembered)."""
        for depth in range(len(keys), 0, -1):
            if (replica := self.owner.get(keys[depth - 1])) is not None and replica in replicas:
                return replica, depth
        return None, 0

    def record(self, keys: Sequence[bytes], replica: Hashable) -> None:
        for key in keys:
            self._drop(self.owner.get(key))
            self.owner[key] = replica
            self.owner.move_to_end(key)
            self.held[replica] = self.held.get(replica, 0) + 1
        while len(self.owner) > self.capacity:
            self._drop(self.owner.popitem(last=False)[1])

    def _drop(self, replica: Hashable | None) -> None:
        if replica is not None:
            self.held[replica] -= 1


@dataclass(frozen=True)
class Choice:
    replica: Hashable
    reason: str   # AFFINITY, OVERFLOW or LEAST_LOADED


def least_loaded(loads: Mapping[Hashable, int], held: Mapping[Hashable, int]) -> Hashable:
    """Fewest requests in flight; among those, fewest remembered keys; then the smallest id (deterministic)."""
    return min(loads, key=lambda r: (loads[r], held.get(r, 0), str(r)))


def choose(keys: Sequence[bytes], loads: Mapping[Hashable, int], table: AffinityTable, overload: int,
           min_share: float = MIN_SHARE) -> Choice:
    """The replica for a prompt with these `keys`; `loads` holds every live replica's requests in flight."""
    if not loads:
        raise ValueError("no replica to choose from")
    lightest = least_loaded(loads, table.held)
    affine, depth = table.deepest(keys, set(loads))
    if affine is None or depth < min_share * len(keys):
        return Choice(lightest, LEAST_LOADED)
    if loads[affine] - loads[lightest] > overload:
        return Choice(lightest, OVERFLOW)
    return Choice(affine, AFFINITY)


@dataclass(frozen=True)
class RouteHint:
    """What the ingress tells the router about a request: the prompt's leading token ids (None: no prompt,
    or one the ingress could not read; the replica answers that request itself), or the one replica a
    request is meant for (a /metrics scrape asks each replica in turn)."""
    prefix_ids: tuple[int, ...] | None = None
    replica: str | None = None
