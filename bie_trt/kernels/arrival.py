"""Arrival counters for kernels whose last-arriving program finishes a shared result (the W4
split-K sum, the attention partition merge), so the finishing step needs no second launch."""
from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, shared by every launch on the device: the program that finishes a
    result sets its counter back to 0, and launches on one stream do not overlap. Allocated on the
    first (warm-up) step, before any CUDA graph is captured."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < count:
        c = _COUNTERS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return c
