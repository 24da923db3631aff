"""The request path every generating route shares: prompts checked against the context and the
queue, started as engine requests (n per prompt), then waited for or streamed as server-sent events,
with timeouts, engine faults and clients that leave handled once for all of them."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
import json
import math
import time
from typing import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..errors import BieError, RequestError
from ..executor.prompt_checks import ContextTooLong
from ..executor.outputs import RequestOutput, StreamEvent
from ..executor.streams import RequestStream
from ..sampling_params import ConstraintError, SamplingParams, StructuredOutputs
from .errors import ApiError, error_body
from .metrics import Metrics
from .protocols.openai import SamplingRequest
from .reply_format import ParamError, ToolSetup, error_param, output_constraint
from .state import ServerState

DISCONNECT_POLL_S = 0.1   # how often a non-streamed request checks that its client is still there
RETRY_AFTER_S = 1         # what a 503 (queue full) asks the client to wait


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                    constraint: StructuredOutputs | None, choice: int = 0) -> SamplingParams:
    """Choice `choice`'s params: seeded seed + choice, reproducible and distinct from its siblings'."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        max_tokens=max_tokens, stop=stop, stop_token_ids=req.stop_token_ids,
        seed=None if req.seed is None else req.seed + choice,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, logprobs=logprobs,
        structured_outputs=constraint, logit_bias=req.logit_bias, min_tokens=req.min_tokens,
        # a reply shaped whole by a constraint has no reasoning block: there is nothing for a budget to bound
        thinking_budget=req.thinking_token_budget if constraint is None else None)


def usage(outputs: list[RequestOutput], n: int) -> dict:
    """Each prompt counted once (its n choices share it); the completion tokens of every choice; the
    prompt tokens the prefix cache served (either tier) as OpenAI reports them."""
    prompt = sum(out.usage.prompt_tokens for out in outputs[::n])
    cached = sum(out.usage.cached_tokens for out in outputs[::n])
    completion = sum(out.usage.completion_tokens for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _iterate(events: RequestStream, metrics: Metrics, start: float) -> AsyncIterator[StreamEvent]:
    """The engine's events as its loop thread posts them onto this event loop (no thread waits for them),
    timed; the stream is always closed, so a client that goes away mid-stream (the response is cancelled)
    aborts its request and frees its blocks."""
    last = None
    try:
        async for event in events:
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
            await events.aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def typed_sse(obj: dict) -> str:
    """An event named by its `type`, as Anthropic's and the Responses API's streams send them."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n"


@dataclass(frozen=True)
class Wire:
    """How a route's API frames its stream and shapes its errors: `frame` writes one event, `done` ends
    the stream (OpenAI's `data: [DONE]`, nothing for typed streams), `error` is the body of a failure
    (as a response, or as the stream's last event once the status is sent), `failed` that last event
    where the API has its own (the Responses API's `response.failed`)."""

    frame: Callable[[dict], str] = _sse
    done: str = "data: [DONE]\n\n"
    error: Callable[[int, str], dict] = error_body
    failed: Callable[[int, str], dict] | None = None


OPENAI_WIRE = Wire()


async def submit(state: ServerState, encode: Callable[[], list[list[int]]], num_prompts: int, req: SamplingRequest,
                 max_tokens: int | None, logprobs: int | None, chat: bool, tools: ToolSetup | None = None
                 ) -> tuple[list[RequestStream], list[list[int]]]:
    """Check the queue against its bound, then in one worker thread (the request's one hop off the event
    loop): the `num_prompts` prompts encoded (`encode`, which raises ApiError for what it refuses), each
    one's SamplingParams made (the context bounds its max_tokens) and n requests per prompt started
    (choice j seeded seed + j: reproducible and distinct; the engine compiles a grammar and checks the
    prompt against the context as a request starts). Nothing starts unless all can. -> the streams and
    the prompts' ids."""
    engine = state.engine
    param = "messages" if chat else "prompt"
    fields = set(type(req).model_fields)
    try:
        constraint, constraint_param = output_constraint(req, tools, state.options.json_schema_mode)
    except ParamError as e:
        raise ApiError(400, str(e), e.param) from None
    count = num_prompts * req.n
    if state.in_flight + count > state.capacity:
        raise ApiError(503, f"the server is full ({state.in_flight} requests in flight, at most "
                            f"{state.capacity}); retry after {RETRY_AFTER_S} s.",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    state.in_flight += count   # held while the requests start, so that concurrent ones see them

    def params_for(ids: list[int], choice: int) -> SamplingParams:
        # what the context leaves for the completion; a prompt that leaves nothing is the engine's to refuse
        # (ContextTooLong, the one check of the context), so at least 1 here
        room = max(engine.max_model_len - len(ids), 1)
        # max_tokens is an upper bound the context may lower: agents send 32,000 to mean "as long as you
        # can"; the reply that reaches the bound ends as `length`, as one that reaches max_tokens does
        wanted = room if max_tokens is None else min(max_tokens, room)
        try:
            return sampling_params(req, wanted, logprobs, constraint, choice)
        except ConstraintError as e:   # checked as the SDK's are; named by the field it came from
            raise ApiError(400, f"{constraint_param}: {e}", constraint_param) from None
        except RequestError as e:
            raise ApiError(400, str(e), error_param(str(e), fields, constraint_param)) from None

    def refusal(i: int, e: BieError, several: bool) -> ApiError:
        """Prompt i's refusal by the engine, naming the field it came from."""
        if isinstance(e, ContextTooLong):   # OpenAI's code, which agents read to compact the conversation
            return ApiError(400, f"{param}[{i}]: {e}" if several else str(e), param, code="context_length_exceeded")
        where = error_param(str(e), fields, constraint_param or param)
        return ApiError(400, f"{param}[{i}]: {e}" if several and where == param else str(e), where)

    def prepare() -> tuple[list[RequestStream], list[list[int]]]:
        prompts = encode()
        per_prompt = [[params_for(ids, j) for j in range(req.n)] for ids in prompts]   # each made (checked) once
        streams: list[RequestStream] = []
        for i, (ids, choices) in enumerate(zip(prompts, per_prompt)):
            try:
                for params in choices:
                    streams.append(engine.stream(ids, params))
            except BaseException as e:
                for events in streams:
                    events.close()
                if isinstance(e, BieError):
                    raise refusal(i, e, len(prompts) > 1) from None
                raise
        return streams, prompts

    try:
        started, prompts = await state.prepare(prepare)
    except BaseException:
        state.in_flight -= count
        raise
    state.live.update(started)
    return started, prompts


ChunkMaker = Callable[[StreamEvent, int, bool], list[dict]]
BodyMaker = Callable[[list[RequestOutput]], dict]


async def respond(state: ServerState, http: Request, streams: list[RequestStream], req: SamplingRequest, base: dict,
                  make_chunk: ChunkMaker, make_body: BodyMaker, wire: Wire = OPENAI_WIRE) -> Response | dict:
    """Wait for every choice (or stream them as they come), then free the queue slots. A fault in the
    engine fails this request with 500, a timeout with 408, a client that leaves aborts it."""
    start, n = time.perf_counter(), len(streams)
    outputs: list[RequestOutput | None] = [None] * n
    faults: list[Exception] = []
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    timeout = state.options.request_timeout

    async def pump(i: int, events: RequestStream, group: anyio.CancelScope, send=None) -> None:
        """Choice i's events into `outputs` (its last) and, when streaming, into `send`."""
        async with send or contextlib.nullcontext():   # closing its end tells the reader this choice is done
            try:
                async for event in _iterate(events, state.metrics, start):
                    if event.output is not None:
                        outputs[i] = event.output
                    if send is not None:
                        await send.send((i, event))
            except Exception as e:   # a fault inside the engine's step: the whole request fails
                faults.append(e)
                group.cancel()

    def fault_body(shape: Callable[[int, str], dict] = wire.error) -> dict:
        return shape(500, f"the engine failed while serving this request: {faults[0]}")

    def timeout_body(shape: Callable[[int, str], dict] = wire.error) -> dict:
        return shape(408, f"the request did not finish within the server's --request-timeout of "
                          f"{timeout} s; ask for fewer tokens or retry later.")

    def release() -> None:
        state.in_flight -= n
        state.live.difference_update(streams)

    if not req.stream:
        try:
            with anyio.move_on_after(timeout) as deadline:
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
            with anyio.move_on_after(timeout) as deadline:
                async with anyio.create_task_group() as choices:
                    async with send:
                        for i, events in enumerate(streams):
                            choices.start_soon(pump, i, events, choices.cancel_scope, send.clone())
                    async with receive:
                        async for i, event in receive:
                            for chunk in make_chunk(event, i, first[i]):
                                yield wire.frame(chunk)
                            first[i] = False
            if faults or deadline.cancelled_caught:   # the status is sent already: the error is an event
                late = wire.failed or wire.error
                yield wire.frame(fault_body(late) if faults else timeout_body(late))
            elif include_usage:
                yield wire.frame(dict(base, choices=[], usage=usage(outputs, req.n)))
            yield wire.done
        finally:
            release()

    return StreamingResponse(sse(), media_type="text/event-stream")
