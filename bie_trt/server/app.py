"""OpenAI-compatible HTTP server over one BieEngine.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (each streamed as server-sent events ending in `data: [DONE]` when
`stream` is true; `logprobs` in the shape of each API; `n` choices; a list of prompts; output
constraints and tool calls), Anthropic's POST /v1/messages and /v1/messages/count_tokens, OpenAI's
POST /v1/responses (and GET / DELETE /v1/responses/{id}) on the same request path, POST /tokenize and /detokenize (vLLM's), POST /v1/cache/save and
/v1/cache/restore (a prompt's KV cache to and from a file under --kv-cache-dir). Every error
has the shape of its route's API (errors.py) and a client's mistake is never a 5xx. Every request runs on the
engine's one loop, batched with the others in flight; a client that leaves aborts its requests.

The handlers live in one module per API, which registers that API's routes (`register`); the chat
request path they share is chat_path.py. This module only installs them all (install_routes, which a
replica deployment calls on its own app) and adds the middleware of a standalone server (create_app).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

import anyio
from fastapi import FastAPI

from ..executor.engine import BieEngine
from . import cache_routes, completions, info, messages, responses, tokens
from .auth import ApiKeyMiddleware
from .body_text import TextCheckedRoute
from .errors import install_error_handlers
from .file_check import BackgroundFileCheck, DamagedEngineMiddleware
from .limits import BodySizeLimit, default_max_request_bytes
from .state import ServerOptions, ServerState

__all__ = ["ServerOptions", "ServerState", "create_app", "install_routes"]


def install_routes(app: FastAPI, state: ServerState) -> None:
    """Every route of the server on `app`: each API's module registers its own, calling its handlers with
    `state`. Every route checks its body for text that is not Unicode first (TextCheckedRoute)."""
    install_error_handlers(app)
    app.router.route_class = TextCheckedRoute   # for the routes registered below
    for api in (info, completions, messages, responses, tokens, cache_routes):
        api.register(app, state)


def create_app(engine: BieEngine, options: ServerOptions | None = None) -> FastAPI:
    state = ServerState(engine, options)
    options = state.options
    file_check = None if engine.config.skip_verify else BackgroundFileCheck(engine.config.engine_dir)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if file_check is not None:
            file_check.start()
        yield
        # Shutting down: the grace period is over and uvicorn has cancelled the responses still running,
        # but a response parked between two chunks never notices; end what is left on the engine's loop.
        await anyio.to_thread.run_sync(state.close_live)

    app = FastAPI(title="bie-trt", description="OpenAI-compatible server for a bie-trt engine", lifespan=lifespan)
    install_routes(app, state)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    if file_check is not None:
        app.add_middleware(DamagedEngineMiddleware, check=file_check)
    app.add_middleware(BodySizeLimit, limit=options.max_request_bytes or default_max_request_bytes(engine.max_model_len))
    return app
