"""The host tier's storage: blocks evicted from the device KV pools, in their own layout (a quantised
block's codes and scale/zero records as they are, an FP16 block's K and V), one slot each.

The block manager's host cache (cache_tiers/host_cache.py) decides which slot holds what and keeps the
total under its bound; this pool only copies. On a GPU the slots are pinned host memory and the copies
are asynchronous on the device's stream (ordered with the quantisations and the forward around them);
on the CPU it is simply a second pool of tensors.
"""
from __future__ import annotations

import time

import torch

from .pool import KVPools, decode_block

def block_bytes(pools: KVPools) -> dict[bool, int]:
    """Bytes of one block, every layer's K and V: is quantised -> size."""
    out = {False: 2 * pools.k[:, 0].nbytes}
    if pools.k_pack is not None:
        out[True] = 2 * pools.k_pack[:, 0].nbytes
    return out


class HostPool:
    def __init__(self, pools: KVPools):
        self.pools = pools
        self.pin = pools.k.is_cuda
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes_offloaded = self.bytes_restored = 0
        self.seconds_offloading = self.seconds_restoring = 0.0

    def _sides(self, entry: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The (K, V) pool tensors holding `entry`, and its block id in them."""
        quantised, block = decode_block(entry)
        if quantised:
            return self.pools.k_pack, self.pools.v_pack, block
        return self.pools.k, self.pools.v, block

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slots.values())

    def offload(self, entry: int, slot: int) -> None:
        """Device block `entry` -> host `slot`."""
        start = time.perf_counter()
        copies = self.snapshot(entry)
        self.slots[slot] = copies
        self.bytes_offloaded += copies[0].nbytes + copies[1].nbytes
        self.seconds_offloading += time.perf_counter() - start

    def restore(self, slot: int, entry: int) -> None:
        """Host `slot` -> device block `entry`; the slot is freed."""
        start = time.perf_counter()
        k, v, block = self._sides(entry)
        host_k, host_v = self.slots.pop(slot)
        k[:, block].copy_(host_k, non_blocking=self.pin)
        v[:, block].copy_(host_v, non_blocking=self.pin)
        self.bytes_restored += host_k.nbytes + host_v.nbytes
        self.seconds_restoring += time.perf_counter() - start

    def drop(self, slot: int) -> None:
        del self.slots[slot]

    def put(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host `slot` holds a block read from elsewhere (a cache file)."""
        self.slots[slot] = tuple(t.pin_memory() if self.pin else t for t in (k, v))

    def snapshot(self, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of device block `entry`'s K and V, launched on the device's stream: on a GPU they land
        asynchronously (before any later kernel can overwrite the block); wait for an event recorded after
        them before reading."""
        k, v, block = self._sides(entry)
        out = []
        for side in (k, v):
            host = torch.empty(side[:, block].shape, dtype=side.dtype, device="cpu", pin_memory=self.pin)
            out.append(host.copy_(side[:, block], non_blocking=self.pin))
        return out[0], out[1]

    def read(self, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of device block `entry`'s K and V, on the CPU."""
        k, v, block = self._sides(entry)
        return k[:, block].cpu(), v[:, block].cpu()
