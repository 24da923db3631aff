"""The device names bie-trt accepts: auto, cpu, cuda and cuda:N."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import BieError

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_HELP = "auto (a GPU the engine was built for, else cpu), cpu, cuda or cuda:N."


def check_device_name(name: str) -> str:
    """`name` if bie-trt can run on it here; otherwise a BieError listing the choices (checked before
    an engine loads, which takes a while)."""
    if not DEVICE_RE.fullmatch(name):
        raise BieError(f"device {name!r} is unknown; choose {DEVICE_HELP}")
    if name.startswith("cuda"):
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (int(name.split(":")[1]) if ":" in name else 0) >= available:
            raise BieError(f"device {name}: this machine has {available} CUDA GPU(s) visible to PyTorch; "
                           f"use --device cpu or auto.")
    return name


def concrete(device: "torch.device | str") -> "torch.device":
    """`device` with its index: a bare "cuda" is the current GPU. PyTorch compares cuda and cuda:0 as
    different devices, and some of its calls (the memory cap) refuse a device without an index."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
