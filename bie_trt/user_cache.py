"""The user cache both sides share: built-in checkpoints fetched for a build, the engine kernels' compile
cache, the integrity ledger of verified engine files, the disk KV tier's default directory."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BIE_TRT_CACHE", Path.home() / ".cache" / "bie-trt"))
