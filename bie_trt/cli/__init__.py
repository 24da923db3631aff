"""`bie-trt` command line: `main` with every command registered on it."""
from __future__ import annotations

from . import cache_cmds, eval_cmds, model_cmds, plan_cmds, serve_cmds  # noqa: F401  (registration)
from .group import main

__all__ = ["main"]
