"""The handlers of POST /v1/cache/save and /v1/cache/restore: a prompt's KV cache to and from a file
under the server's --kv-cache-dir."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import anyio
import jinja2
from fastapi import FastAPI

from ..errors import BieError
from ..cache_tiers.cache_file import CacheFileError
from .errors import ApiError
from .protocols.openai import CacheRequest
from .state import ServerState


async def _cache_file(state: ServerState, req: CacheRequest, action: Callable[[Path, Any, bool], dict]) -> dict:
    if state.options.kv_cache_dir is None:
        raise ApiError(400, "this server keeps no cache files; start it with --kv-cache-dir DIR.", "file")
    if req.messages is not None:
        prompt, chat = [m.to_template() for m in req.messages], True
    else:
        prompt, chat = req.prompt, False
    path = Path(state.options.kv_cache_dir) / req.file
    try:
        return await anyio.to_thread.run_sync(action, path, prompt, chat)
    except FileNotFoundError:
        raise ApiError(404, f"no cache file {req.file!r} in this server's --kv-cache-dir.", "file") from None
    except (jinja2.TemplateError, BieError) as e:
        raise ApiError(400, str(e), "file" if isinstance(e, CacheFileError) else "prompt") from None


async def cache_save(state: ServerState, req: CacheRequest) -> dict:
    """A prompt's KV cache (prefilled first unless cached) to a file: {"file", "tokens", "blocks", "bytes"}."""
    if req.prompt is None and req.messages is None:
        raise ApiError(400, "send the prompt (or messages) whose cache to save.", "prompt")
    return await _cache_file(state, req, lambda path, prompt, chat: {**state.engine.save_cache(prompt, path, chat),
                                                                     "file": req.file})


async def cache_restore(state: ServerState, req: CacheRequest) -> dict:
    """A saved cache back into the prefix cache: {"file", "tokens", "blocks"}."""
    def restore(path: Path, prompt: Any, chat: bool) -> dict:
        if not path.is_file():
            raise FileNotFoundError(path)
        return {**state.engine.load_cache(path, prompt, chat), "file": req.file}

    return await _cache_file(state, req, restore)


def register(app: FastAPI, state: ServerState) -> None:
    """POST /v1/cache/save and /v1/cache/restore on `app`."""

    @app.post("/v1/cache/save")
    async def cache_save_route(req: CacheRequest):
        return await cache_save(state, req)

    @app.post("/v1/cache/restore")
    async def cache_restore_route(req: CacheRequest):
        return await cache_restore(state, req)
