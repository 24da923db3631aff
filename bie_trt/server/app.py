"""OpenAI-compatible HTTP server over one BieEngine.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (each streamed as server-sent events ending in `data: [DONE]` when
`stream` is true; `logprobs` in the shape of each API; `n` choices). Bad requests get HTTP 400
with an OpenAI-style error body, and the server keeps serving. Every request runs on the engine's
one loop, batched with the others in flight; a client that leaves aborts its requests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..config import SamplingParams
from ..errors import BieError
from ..executor.engine import BieEngine, RequestOutput, RequestStream, StreamEvent
from .metrics import CONTENT_TYPE, Metrics

DISCONNECT_POLL_S = 0.1   # how often a non-streamed request checks that its client is still there
MAX_CHOICES = 16          # n per request: each choice is a request on the loop


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")   # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None        # top-N alternatives per token (0: the sampled token's only)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _params(req: _Request, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        max_tokens=max_tokens if max_tokens is not None else 16, stop=stop, stop_token_ids=req.stop_token_ids,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, logprobs=logprobs)


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: -item[1])[:n]


def completion_logprobs(tokens: list[int], logprobs: list[dict[int, float]], n: int, decode: Callable[[int], str],
                        offset: int = 0) -> dict[str, list]:
    """The completions API's shape: parallel lists of token texts, their logprobs, the top n of each
    position, and where each token starts in the completion's text (from `offset`)."""
    texts = [decode(t) for t in tokens]
    return {"tokens": texts, "token_logprobs": [lp[t] for t, lp in zip(tokens, logprobs)],
            "top_logprobs": [{decode(i): v for i, v in _top(lp, n)} for lp in logprobs],
            "text_offset": list(itertools.accumulate([len(t) for t in texts[:-1]], initial=offset))}


def chat_logprobs(tokens: list[int], logprobs: list[dict[int, float]], n: int,
                  decode: Callable[[int], str]) -> dict[str, list]:
    """The chat API's shape: one entry per token with its text, logprob, UTF-8 bytes and top n."""
    def entry(token: int, value: float) -> dict[str, Any]:
        text = decode(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {"content": [dict(entry(t, lp[t]), top_logprobs=[entry(i, v) for i, v in _top(lp, n)])
                        for t, lp in zip(tokens, logprobs)]}


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """One prompt, counted once; the completion tokens of every choice."""
    prompt, completion = outputs[0].usage.prompt_tokens, sum(out.usage.completion_tokens for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


async def _iterate(events: RequestStream, metrics: Metrics, start: float) -> AsyncIterator[StreamEvent]:
    """Wait for the engine's events in worker threads, timing them; always close the stream, so a client
    that goes away mid-stream (the response is cancelled) aborts its request and frees its blocks."""
    done, last = object(), None
    try:
        while (event := await anyio.to_thread.run_sync(next, events, done, abandon_on_cancel=True)) is not done:
            now = time.perf_counter()
            if event.token_ids:
                if last is None:
                    metrics.ttft.observe(now - start)
                else:
                    metrics.itl.observe((now - last) / len(event.token_ids))
                last = now
            yield event
    finally:
        with anyio.CancelScope(shield=True):   # a cancelled response must still abort its request
            await anyio.to_thread.run_sync(events.close)   # also wakes the abandoned next() above


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(engine: BieEngine) -> FastAPI:
    app = FastAPI(title="bie-trt", description="OpenAI-compatible server for a bie-trt engine")
    model_id = engine.model_name
    metrics = Metrics()

    def decode(token: int) -> str:
        return engine.tokenizer.decode([token])

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return openai_error(400, f"invalid request: {where}: {first.get('msg', exc)}", param=where)

    @app.exception_handler(BieError)
    async def _bad(_: Request, exc: BieError) -> JSONResponse:
        return openai_error(400, str(exc))

    def check_model(req: _Request) -> JSONResponse | None:
        if req.model not in (None, model_id):
            return openai_error(404, f"model {req.model!r} does not exist; this server serves {model_id!r}.",
                                param="model", code="model_not_found")
        if not 1 <= req.n <= MAX_CHOICES:
            return openai_error(400, f"n must be between 1 and {MAX_CHOICES}; got {req.n}.", param="n")
        return None

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "bie-trt", "max_model_len": engine.max_model_len}]}

    async def run(http: Request, prompt, params: SamplingParams, chat: bool, req: _Request, base: dict, make_chunk,
                  make_body):
        """Serve `req.n` choices: n requests on the engine's loop, each with its own seed when one is
        given (seed + i: reproducible and distinct). Every request is aborted if the client leaves."""
        start = time.perf_counter()
        streams: list[RequestStream] = []
        try:
            for i in range(req.n):   # each validates before any byte is sent
                seed = None if params.seed is None else params.seed + i
                streams.append(engine.stream(prompt, dataclasses.replace(params, seed=seed), chat=chat))
        except BaseException:
            for events in streams:
                events.close()
            raise
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        outputs: list[RequestOutput | None] = [None] * req.n

        async def pump(i: int, events: RequestStream, send=None) -> None:
            """Choice i's events into `outputs` (its last) and, when streaming, into `send`."""
            async with send or contextlib.nullcontext():   # closing its end tells the reader this choice is done
                async for event in _iterate(events, metrics, start):
                    if event.output is not None:
                        outputs[i] = event.output
                    if send is not None:
                        await send.send((i, event))

        if not req.stream:
            async with anyio.create_task_group() as tasks:
                async def abort_when_client_leaves() -> None:
                    # nothing is sent until the end, so only polling notices a client that went away;
                    # cancelling the waits below closes the streams, which aborts the requests
                    while not await http.is_disconnected():
                        await anyio.sleep(DISCONNECT_POLL_S)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(abort_when_client_leaves)
                async with anyio.create_task_group() as choices:
                    for i, events in enumerate(streams):
                        choices.start_soon(pump, i, events)
                tasks.cancel_scope.cancel()
            if any(out is None for out in outputs):   # the client left: nobody reads a reply
                return PlainTextResponse("client disconnected", status_code=499)
            return make_body(outputs)

        async def sse() -> AsyncIterator[str]:
            send, receive = anyio.create_memory_object_stream(math.inf)
            first = [True] * req.n
            async with anyio.create_task_group() as choices:
                async with send:
                    for i, events in enumerate(streams):
                        choices.start_soon(pump, i, events, send.clone())
                async with receive:
                    async for i, event in receive:
                        for chunk in make_chunk(event, i, first[i]):
                            yield _sse(chunk)
                        first[i] = False
            if include_usage:
                yield _sse(dict(base, choices=[], usage=_usage(outputs)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        if (err := check_model(req)) is not None:
            return err
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
            if len(req.prompt) != 1:
                return openai_error(400, "send one prompt per request (batched prompts are not supported).",
                                    param="prompt")
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
        offsets = [0] * req.n   # characters of each choice's token text so far: where its next tokens start

        def logprobs(i: int, tokens: list[int], values: list[dict[int, float]] | None) -> dict | None:
            if req.logprobs is None or values is None:
                return None
            shaped = completion_logprobs(tokens, values, req.logprobs, decode, offsets[i])
            offsets[i] += sum(len(t) for t in shaped["tokens"])
            return shaped

        def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
            return [dict(base, choices=[{"index": i, "text": event.delta,
                                         "logprobs": logprobs(i, event.token_ids, event.logprobs),
                                         "finish_reason": event.finish_reason}])]

        def make_body(outputs: list[RequestOutput]) -> dict:
            return dict(base, choices=[{"index": i, "text": out.text,
                                        "logprobs": logprobs(i, out.token_ids, out.logprobs),
                                        "finish_reason": out.finish_reason} for i, out in enumerate(outputs)],
                        usage=_usage(outputs))

        return await run(http, prompt, _params(req, req.max_tokens, req.logprobs), False, req, base, make_chunk,
                         make_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, http: Request):
        if (err := check_model(req)) is not None:
            return err
        if not req.messages:
            return openai_error(400, "messages must not be empty.", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            return openai_error(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id}

        def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
            chunks = []
            if first:
                chunks.append(dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None}]))
            delta = {"content": event.delta} if event.delta else {}
            choice = {"index": i, "delta": delta, "finish_reason": event.finish_reason}
            if top_n is not None:
                choice["logprobs"] = chat_logprobs(event.token_ids, event.logprobs, top_n, decode)
            chunks.append(dict(base, choices=[choice]))
            return chunks

        def make_body(outputs: list[RequestOutput]) -> dict:
            choices = []
            for i, out in enumerate(outputs):
                choice = {"index": i, "message": {"role": "assistant", "content": out.text},
                          "finish_reason": out.finish_reason}
                if top_n is not None:
                    choice["logprobs"] = chat_logprobs(out.token_ids, out.logprobs, top_n, decode)
                choices.append(choice)
            return dict(base, object="chat.completion", choices=choices, usage=_usage(outputs))

        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await run(http, messages, _params(req, max_tokens, top_n), True, req, base, make_chunk, make_body)

    return app
