"""OpenAI-compatible HTTP server over one BieEngine.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (each streamed as server-sent events ending in `data: [DONE]` when
`stream` is true; `logprobs` in the shape of each API; `n` choices; a list of prompts; output
constraints and tool calls), POST /tokenize and /detokenize (vLLM's), POST /v1/cache/save and
/v1/cache/restore (a prompt's KV cache to and from a file under --kv-cache-dir). Every error
has OpenAI's shape (errors.py) and a client's mistake is never a 5xx. Every request runs on the
engine's one loop, batched with the others in flight; a client that leaves aborts its requests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..config import SamplingParams
from ..errors import BieError, RequestError
from ..executor.cache_file import CacheFileError
from ..executor.engine import BieEngine
from ..executor.outputs import RequestOutput, StreamEvent
from ..executor.prompts import check_prompt
from ..executor.streams import RequestStream
from .auth import ApiKeyMiddleware
from .errors import error_body, install_error_handlers, openai_error
from .file_check import BackgroundFileCheck, DamagedEngineMiddleware
from .limits import BodySizeLimit, default_max_request_bytes, longest_token_chars, min_tokens
from .metrics import CONTENT_TYPE, Metrics
from .protocol import CacheRequest, ChatRequest, CompletionRequest, DetokenizeRequest, SamplingRequest, TokenizeRequest
from .structured import ParamError, ToolPlan, error_param, output_constraint, tool_plan

DISCONNECT_POLL_S = 0.1   # how often a non-streamed request checks that its client is still there
MAX_REQUESTS = 64         # prompts x n in one HTTP request: each is a request on the loop
EVENT_WAITERS = 1024      # threads waiting for engine events (one per streaming choice in flight)
RETRY_AFTER_S = 1         # what a 503 (queue full) asks the client to wait


@dataclass
class ServerOptions:
    served_model_name: str | None = None   # the `model` clients send and /v1/models lists (default: the engine's)
    api_key: str | None = None             # None: no authentication
    max_waiting: int | None = None         # requests queued beyond the running batch; None: unbounded
    request_timeout: float | None = None   # seconds a request may take before it is aborted; None: no limit
    max_request_bytes: int | None = None   # larger bodies get 413 unread; None: from the context length
    kv_cache_dir: str | None = None        # where /v1/cache/save and /restore keep files; None: those routes are off


def _params(req: SamplingRequest, max_tokens: int, logprobs: int | None, constraint) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        max_tokens=max_tokens, stop=stop, stop_token_ids=req.stop_token_ids,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, logprobs=logprobs,
        structured_outputs=constraint, logit_bias=bias, min_tokens=req.min_tokens)


def context_error(max_model_len: int, prompt_tokens: int, max_tokens: int, chat: bool) -> str:
    """The message OpenAI and vLLM send when prompt plus completion exceed the context."""
    what = "messages" if chat else "prompt"
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The completions API's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


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


async def _iterate(events: RequestStream, metrics: Metrics, start: float,
                   waiters: anyio.CapacityLimiter) -> AsyncIterator[StreamEvent]:
    """Wait for the engine's events in worker threads (from their own pool, so that many long streams
    do not starve other work of threads), timing them; always close the stream, so a client that goes
    away mid-stream (the response is cancelled) aborts its request and frees its blocks."""
    done, last = object(), None
    try:
        while (event := await anyio.to_thread.run_sync(next, events, done, abandon_on_cancel=True,
                                                       limiter=waiters)) is not done:
            now = time.perf_counter()
            if event.token_ids:
                if last is None:
                    metrics.ttft.observe(now - start)
                else:
                    metrics.itl.observe((now - last) / len(event.token_ids))
                last = now
            if event.output is not None:
                metrics.e2e.observe(now - start)
            yield event
    finally:
        with anyio.CancelScope(shield=True):   # a cancelled response must still abort its request
            await anyio.to_thread.run_sync(events.close)   # also wakes the abandoned next() above


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"




def _usage(outputs: list[RequestOutput], n: int) -> dict:
    """Each prompt counted once (its n choices share it); the completion tokens of every choice; the
    prompt tokens the prefix cache served (either tier) as OpenAI reports them."""
    prompt = sum(out.usage.prompt_tokens for out in outputs[::n])
    cached = sum(out.usage.cached_tokens for out in outputs[::n])
    completion = sum(out.usage.completion_tokens for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def create_app(engine: BieEngine, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    live: set[RequestStream] = set()   # the engine requests of every HTTP request in flight

    file_check = None if engine.config.skip_verify else BackgroundFileCheck(engine.config.engine_dir)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if file_check is not None:
            file_check.start()
        yield
        # Shutting down: the grace period is over and uvicorn has cancelled the responses still running,
        # but a response parked between two chunks never notices; end what is left on the engine's loop.
        leftover = list(live)
        await anyio.to_thread.run_sync(lambda: [events.close() for events in leftover])

    app = FastAPI(title="bie-trt", description="OpenAI-compatible server for a bie-trt engine", lifespan=lifespan)
    install_error_handlers(app)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    if file_check is not None:
        app.add_middleware(DamagedEngineMiddleware, check=file_check)
    body_limit = options.max_request_bytes or default_max_request_bytes(engine.max_model_len)
    app.add_middleware(BodySizeLimit, limit=body_limit)
    model_id = options.served_model_name or engine.model_name
    started = int(time.time())   # /v1/models' "created": when this server made the model available
    longest_token = longest_token_chars(engine.tokenizer.get_vocab())
    metrics = Metrics(engine.stats)
    # requests admitted and not yet finished; beyond the running batch plus --max-waiting, new ones get 503
    capacity = math.inf if options.max_waiting is None else engine.scheduler.max_num_seqs + options.max_waiting
    state = {"in_flight": 0, "waiters": None}

    def decode(token: int) -> str:
        return engine.tokenizer.decode([token])

    def waiters() -> anyio.CapacityLimiter:
        if state["waiters"] is None:   # made inside the event loop, on first use
            state["waiters"] = anyio.CapacityLimiter(EVENT_WAITERS)
        return state["waiters"]

    def check_model(req: SamplingRequest) -> JSONResponse | None:
        if req.model not in (None, model_id):
            return openai_error(404, f"model {req.model!r} does not exist; this server serves {model_id!r}.",
                                param="model", code="model_not_found")
        return None

    def cannot_fit(texts: list[str], chat: bool) -> JSONResponse | None:
        """A prompt whose length alone rules out the context, refused before it is tokenised."""
        chars = sum(map(len, texts))
        if (least := min_tokens(chars, longest_token)) < engine.max_model_len:
            return None
        what = "messages" if chat else "prompt"
        return openai_error(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, "
                                 f"the {what} ({chars:,} characters) holds at least {least:,} tokens. Please reduce "
                                 f"the length of the {what}.", what, code="context_length_exceeded")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": started,
                                            "owned_by": "bie-trt", "max_model_len": engine.max_model_len}]}

    async def submit(prompts: list[list[int]], req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                     chat: bool, tools: ToolPlan | None = None) -> list[RequestStream] | JSONResponse:
        """Check every prompt against the context and the queue against its bound, then start n requests
        per prompt (choice j seeded seed + j: reproducible and distinct). Nothing starts unless all can.
        The engine compiles a grammar as a request starts, so requests start in a worker thread."""
        param = "messages" if chat else "prompt"
        try:
            constraint, constraint_param = output_constraint(req, tools)
        except ParamError as e:
            return openai_error(400, str(e), e.param)
        vocab = engine.runner.model_config.vocab_size
        if bad := [k for k in req.logit_bias or {} if int(k) >= vocab]:
            return openai_error(400, f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab}).",
                                "logit_bias")
        per_prompt = []
        for ids in prompts:
            wanted = max_tokens if max_tokens is not None else max(1, engine.max_model_len - len(ids))
            if len(ids) + wanted > engine.max_model_len:
                return openai_error(400, context_error(engine.max_model_len, len(ids), wanted, chat), param,
                                    code="context_length_exceeded")
            try:
                per_prompt.append(_params(req, wanted, logprobs, constraint))
            except RequestError as e:
                return openai_error(400, str(e), error_param(str(e), set(type(req).model_fields),
                                                             constraint_param))
        count = len(prompts) * req.n
        if state["in_flight"] + count > capacity:
            return openai_error(503, f"the server is full ({state['in_flight']} requests in flight, at most "
                                     f"{capacity}); retry after {RETRY_AFTER_S} s.",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        state["in_flight"] += count   # held while the requests start, so that concurrent ones see them

        def start() -> list[RequestStream] | tuple[int, BieError]:
            streams: list[RequestStream] = []
            for i, (ids, params) in enumerate(zip(prompts, per_prompt)):
                try:
                    for j in range(req.n):
                        seed = None if params.seed is None else params.seed + j
                        streams.append(engine.stream(ids, dataclasses.replace(params, seed=seed)))
                except BaseException as e:
                    for events in streams:
                        events.close()
                    if isinstance(e, BieError):
                        return i, e
                    raise
            return streams

        try:
            started = await anyio.to_thread.run_sync(start)
        except BaseException:
            state["in_flight"] -= count
            raise
        if isinstance(started, tuple):
            state["in_flight"] -= count
            i, e = started
            where = error_param(str(e), set(type(req).model_fields), constraint_param or param)
            return openai_error(400, f"{param}[{i}]: {e}" if len(prompts) > 1 and where == param else str(e), where)
        live.update(started)
        return started

    async def respond(http: Request, streams: list[RequestStream], req: SamplingRequest, base: dict, make_chunk,
                      make_body):
        """Wait for every choice (or stream them as they come), then free the queue slots. A fault in the
        engine fails this request with 500, a timeout with 408, a client that leaves aborts it."""
        start, n = time.perf_counter(), len(streams)
        outputs: list[RequestOutput | None] = [None] * n
        faults: list[Exception] = []
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def pump(i: int, events: RequestStream, group: anyio.CancelScope, send=None) -> None:
            """Choice i's events into `outputs` (its last) and, when streaming, into `send`."""
            async with send or contextlib.nullcontext():   # closing its end tells the reader this choice is done
                try:
                    async for event in _iterate(events, metrics, start, waiters()):
                        if event.output is not None:
                            outputs[i] = event.output
                        if send is not None:
                            await send.send((i, event))
                except Exception as e:   # a fault inside the engine's step: the whole request fails
                    faults.append(e)
                    group.cancel()

        def fault_body() -> dict:
            return error_body(500, f"the engine failed while serving this request: {faults[0]}")

        def timeout_body() -> dict:
            return error_body(408, f"the request did not finish within the server's --request-timeout of "
                                   f"{options.request_timeout} s; ask for fewer tokens or retry later.")

        def release() -> None:
            state["in_flight"] -= n
            live.difference_update(streams)

        if not req.stream:
            try:
                with anyio.move_on_after(options.request_timeout) as deadline:
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
                                choices.start_soon(pump, i, events, tasks.cancel_scope)
                        tasks.cancel_scope.cancel()
            finally:
                release()
            if faults:
                return JSONResponse(fault_body(), 500)
            if deadline.cancelled_caught:
                return JSONResponse(timeout_body(), 408)
            if any(out is None for out in outputs):   # the client left: nobody reads a reply
                return PlainTextResponse("client disconnected", status_code=499)
            return make_body(outputs)

        async def sse() -> AsyncIterator[str]:
            try:
                send, receive = anyio.create_memory_object_stream(math.inf)
                first = [True] * n
                with anyio.move_on_after(options.request_timeout) as deadline:
                    async with anyio.create_task_group() as choices:
                        async with send:
                            for i, events in enumerate(streams):
                                choices.start_soon(pump, i, events, choices.cancel_scope, send.clone())
                        async with receive:
                            async for i, event in receive:
                                for chunk in make_chunk(event, i, first[i]):
                                    yield _sse(chunk)
                                first[i] = False
                if faults or deadline.cancelled_caught:   # the status is sent already: the error is an event
                    yield _sse(fault_body() if faults else timeout_body())
                elif include_usage:
                    yield _sse(dict(base, choices=[], usage=_usage(outputs, req.n)))
                yield "data: [DONE]\n\n"
            finally:
                release()

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def tokenize(prompt: str | list[int] | list[dict], chat: bool) -> list[int]:
        return await anyio.to_thread.run_sync(engine.encode, prompt, chat)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        if (err := check_model(req)) is not None:
            return err
        prompts = prompt_list(req.prompt)
        if not prompts:
            return openai_error(400, "prompt must not be empty; send a string, or a list of them.", "prompt")
        if len(prompts) * req.n > MAX_REQUESTS:
            return openai_error(400, f"{len(prompts)} prompts x n {req.n} is more than {MAX_REQUESTS} requests; "
                                     f"send fewer prompts per request.", "prompt")
        for i, p in enumerate(prompts):
            try:
                check_prompt(p, "the prompt" if len(prompts) == 1 else f"prompt[{i}]")
            except BieError as e:
                return openai_error(400, str(e), "prompt")
        for p in prompts:
            if isinstance(p, str) and (err := cannot_fit([p], chat=False)) is not None:
                return err
        ids = [await tokenize(p, False) for p in prompts]
        streams = await submit(ids, req, req.max_tokens, req.logprobs, chat=False)
        if isinstance(streams, JSONResponse):
            return streams
        # echo: each choice's text starts with its prompt (token-id prompts decoded)
        echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if req.echo else "" for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_id}
        offsets = [0] * len(streams)   # characters of each choice's token text so far: where its next tokens start

        def logprobs(i: int, tokens: list[int], values: list[dict[int, float]] | None) -> dict | None:
            if req.logprobs is None or values is None:
                return None
            shaped = completion_logprobs(tokens, values, req.logprobs, decode, offsets[i])
            offsets[i] += sum(len(t) for t in shaped["tokens"])
            return shaped

        def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
            return [dict(base, choices=[{"index": i, "text": echoed[i // req.n] + event.delta if first else event.delta,
                                         "logprobs": logprobs(i, event.token_ids, event.logprobs),
                                         "finish_reason": event.finish_reason}])]

        def make_body(outputs: list[RequestOutput]) -> dict:
            return dict(base, choices=[{"index": i, "text": echoed[i // req.n] + out.text,
                                        "logprobs": logprobs(i, out.token_ids, out.logprobs),
                                        "finish_reason": out.finish_reason} for i, out in enumerate(outputs)],
                        usage=_usage(outputs, req.n))

        return await respond(http, streams, req, base, make_chunk, make_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, http: Request):
        if (err := check_model(req)) is not None:
            return err
        if req.top_logprobs is not None and not req.logprobs:
            return openai_error(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        messages = [m.to_template() for m in req.messages]
        if (err := cannot_fit([m["content"] for m in messages], chat=True)) is not None:
            return err
        try:
            tools = tool_plan(req)
        except ParamError as e:
            return openai_error(400, str(e), e.param)
        try:
            ids = await anyio.to_thread.run_sync(engine.encode_chat, messages, tools.tools)
        except (jinja2.TemplateError, BieError) as e:   # e.g. a template that insists on alternating roles
            return openai_error(400, f"the chat template refused these messages: {e}", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        streams = await submit([ids], req, max_tokens, top_n, chat=True, tools=tools)
        if isinstance(streams, JSONResponse):
            return streams
        parsers = [tools.parser() for _ in streams]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id}

        def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
            """The choice's deltas: prose as it comes, tool calls as they complete (a named function's
            arguments as they come); the event's logprobs and finish reason ride on the last."""
            parser = parsers[i]
            deltas = parser.feed(event.delta)
            if event.finish_reason is not None:
                deltas += parser.finish()
            chunks = [dict(base, choices=[{"index": i, "delta": d, "finish_reason": None}]) for d in deltas or [{}]]
            if first:
                opening = "" if tools.mode in ("none", "auto") else None
                chunks.insert(0, dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": opening},
                                                      "finish_reason": None}]))
            last = chunks[-1]["choices"][0]
            last["finish_reason"] = parser.finish_reason(event.finish_reason, parser.calls > 0)
            if top_n is not None:
                last["logprobs"] = chat_logprobs(event.token_ids, event.logprobs, top_n, decode)
            return chunks

        def make_body(outputs: list[RequestOutput]) -> dict:
            choices = []
            for i, out in enumerate(outputs):
                content, calls = parsers[i].message(out.text)
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                choice = {"index": i, "message": message,
                          "finish_reason": parsers[i].finish_reason(out.finish_reason, bool(calls))}
                if top_n is not None:
                    choice["logprobs"] = chat_logprobs(out.token_ids, out.logprobs, top_n, decode)
                choices.append(choice)
            return dict(base, object="chat.completion", choices=choices, usage=_usage(outputs, req.n))

        return await respond(http, streams, req, base, make_chunk, make_body)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        """vLLM's: a prompt (or chat messages, through the template) -> its token ids."""
        if (err := check_model(req)) is not None:
            return err
        try:
            if req.messages is not None:
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                ids = await anyio.to_thread.run_sync(engine.encode_chat, [m.to_template() for m in req.messages], tools)
            else:
                ids = await anyio.to_thread.run_sync(
                    lambda: list(engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]))
        except (jinja2.TemplateError, BieError) as e:
            return openai_error(400, f"the chat template refused these messages: {e}", "messages")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    async def cache_file(req: CacheRequest, action: Callable[[Path, Any, bool], dict]) -> dict | JSONResponse:
        if (err := check_model(req)) is not None:
            return err
        if options.kv_cache_dir is None:
            return openai_error(400, "this server keeps no cache files; start it with --kv-cache-dir DIR.", "file")
        if req.messages is not None:
            prompt, chat = [m.to_template() for m in req.messages], True
        else:
            prompt, chat = req.prompt, False
        path = Path(options.kv_cache_dir) / req.file
        try:
            return await anyio.to_thread.run_sync(action, path, prompt, chat)
        except FileNotFoundError:
            return openai_error(404, f"no cache file {req.file!r} in this server's --kv-cache-dir.", "file")
        except (jinja2.TemplateError, BieError) as e:
            return openai_error(400, str(e), "file" if isinstance(e, CacheFileError) else "prompt")

    @app.post("/v1/cache/save")
    async def cache_save(req: CacheRequest):
        """A prompt's KV cache (prefilled first unless cached) to a file: {"file", "tokens", "blocks", "bytes"}."""
        if req.prompt is None and req.messages is None:
            return openai_error(400, "send the prompt (or messages) whose cache to save.", "prompt")
        return await cache_file(req, lambda path, prompt, chat: {**engine.save_cache(prompt, path, chat),
                                                                 "file": req.file})

    @app.post("/v1/cache/restore")
    async def cache_restore(req: CacheRequest):
        """A saved cache back into the prefix cache: {"file", "tokens", "blocks"}."""
        def restore(path: Path, prompt, chat: bool) -> dict:
            if not path.is_file():
                raise FileNotFoundError(path)
            return {**engine.load_cache(path, prompt, chat), "file": req.file}

        return await cache_file(req, restore)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        """vLLM's: token ids -> their text."""
        if (err := check_model(req)) is not None:
            return err
        vocab = engine.runner.model_config.vocab_size
        if (bad := next((t for t in req.tokens if not 0 <= t < vocab), None)) is not None:
            return openai_error(400, f"token id {bad} is outside the vocabulary [0, {vocab}).", "tokens")
        return {"prompt": await anyio.to_thread.run_sync(engine.tokenizer.decode, req.tokens)}

    return app
