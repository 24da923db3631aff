"""The device names bie-trt accepts: auto, cpu, cuda and cuda:N."""
from __future__ import annotations

import re

from .errors import BieError

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_HELP = "auto (a GPU the engine was built for, else cpu), cpu, cuda or cuda:N."


def check_device_name(name: str) -> str:
    """`name` if bie-trt can run on it; otherwise a BieError listing the choices."""
    if not DEVICE_RE.fullmatch(name):
        raise BieError(f"device {name!r} is unknown; choose {DEVICE_HELP}")
    return name
