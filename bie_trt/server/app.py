"""OpenAI-compatible HTTP server over one BieEngine.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (each streamed as server-sent events ending in `data: [DONE]` when
`stream` is true; `logprobs` in the shape of each API; `n` choices; a list of prompts; output
constraints and tool calls), Anthropic's POST /v1/messages and /v1/messages/count_tokens, OpenAI's
POST /v1/responses (and GET / DELETE /v1/responses/{id}) on the same request path, POST /tokenize and /detokenize (vLLM's), POST /v1/cache/save and
/v1/cache/restore (a prompt's KV cache to and from a file under --kv-cache-dir). Every error
has the shape of its route's API (errors.py) and a client's mistake is never a 5xx. Every request runs on the
engine's one loop, batched with the others in flight; a client that leaves aborts its requests.

The handlers live in their own modules and take a ServerState; this module only wires them to
FastAPI routes (install_routes, which a replica deployment calls on its own app) and adds the
middleware of a standalone server (create_app).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request

from ..executor.engine import BieEngine
from . import cache_routes, completions, info, messages, responses, tokens
from .protocols.anthropic import CountTokensRequest, MessagesRequest
from .auth import ApiKeyMiddleware
from .errors import install_error_handlers
from .file_check import BackgroundFileCheck, DamagedEngineMiddleware
from .limits import BodySizeLimit, default_max_request_bytes
from .protocols.openai import CacheRequest, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .protocols.responses import ResponsesRequest
from .state import ServerOptions, ServerState

__all__ = ["ServerOptions", "ServerState", "create_app", "install_routes"]


def install_routes(app: FastAPI, state: ServerState) -> None:
    """Every route of the server on `app`, each calling its handler with `state`."""
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return await info.health(state)

    @app.get("/metrics")
    async def prometheus_metrics():
        return await info.metrics(state)

    @app.get("/v1/models")
    async def models() -> dict:
        return await info.models(state)

    @app.post("/v1/completions")
    async def completion_route(req: CompletionRequest, http: Request):
        return await completions.completions(state, req, http)

    @app.post("/v1/chat/completions")
    async def chat_route(req: ChatRequest, http: Request):
        return await completions.chat_completions(state, req, http)

    @app.post("/v1/messages")
    async def messages_route(req: MessagesRequest, http: Request):
        return await messages.messages(state, req, http)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(req: CountTokensRequest):
        return await messages.count_tokens(state, req)

    @app.post("/v1/responses")
    async def responses_route(req: ResponsesRequest, http: Request):
        return await responses.create_response(state, req, http)

    @app.get("/v1/responses/{response_id}")
    async def response_get(response_id: str):
        return await responses.get_response(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def response_delete(response_id: str):
        return await responses.delete_response(state, response_id)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await tokens.tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await tokens.detokenize(state, req)

    @app.post("/v1/cache/save")
    async def cache_save(req: CacheRequest):
        return await cache_routes.cache_save(state, req)

    @app.post("/v1/cache/restore")
    async def cache_restore(req: CacheRequest):
        return await cache_routes.cache_restore(state, req)


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
