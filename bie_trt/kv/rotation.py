"""Walsh–Hadamard rotation of keys and queries.

A few key channels carry outliers many times larger than the rest; one outlier
stretches its INT4 group's range and drowns every other channel in rounding
noise. Multiplying by an orthonormal Hadamard matrix spreads each outlier over
all channels, so groups become even-tempered. Because H is orthonormal,
(q H)·(k H) = q·k: rotating both sides leaves attention scores unchanged.
"""
from __future__ import annotations

import functools
import math

import torch


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The normalised n×n Walsh–Hadamard matrix (symmetric, H @ H.T = I); n a power of two."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size; got {n}.")
    # Normalise the device so "cpu" and torch.device("cpu") share one cache entry.
    return _cached_hadamard(n, dtype, torch.device(device))


@functools.lru_cache(maxsize=None)
def _cached_hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Sylvester's doubling H_2n = [[H, H], [H, -H]], built in fp64 so the 1/sqrt(n)
    # normalisation is exact to the target dtype's last bit.
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H on the last dim, in at least fp32, returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = hadamard_matrix(x.shape[-1], compute, x.device)
    return (x.to(compute) @ h).to(x.dtype)
