"""The handlers of POST /v1/completions and /v1/chat/completions: a body into engine requests
through the shared request path, and the engine's outputs into each API's choices and chunks."""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..errors import BieError
from ..executor.outputs import RequestOutput, StreamEvent
from ..executor.prompt_checks import check_prompt
from .chat_path import reply_processor, start_chat
from .errors import ApiError
from .generation import respond, submit, usage
from .protocols.openai import ChatRequest, CompletionRequest
from .state import ServerState

MAX_REQUESTS = 64         # prompts x n in one HTTP request: each is a request on the loop


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


async def completions(state: ServerState, req: CompletionRequest, http: Request) -> Response | dict:
    engine = state.engine
    prompts = prompt_list(req.prompt)
    if not prompts:
        raise ApiError(400, "prompt must not be empty; send a string, or a list of them.", "prompt")
    if len(prompts) * req.n > MAX_REQUESTS:
        raise ApiError(400, f"{len(prompts)} prompts x n {req.n} is more than {MAX_REQUESTS} requests; "
                            f"send fewer prompts per request.", "prompt")
    for i, p in enumerate(prompts):
        try:
            check_prompt(p, "the prompt" if len(prompts) == 1 else f"prompt[{i}]")
        except BieError as e:
            raise ApiError(400, str(e), "prompt") from None
    streams, _ = await submit(state, lambda: [engine.encode(p, False) for p in prompts], len(prompts), req,
                              req.max_tokens, req.logprobs, chat=False)
    # echo: each choice's text starts with its prompt (token-id prompts decoded)
    echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if req.echo else "" for p in prompts]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id}
    offsets = [0] * len(streams)   # characters of each choice's token text so far: where its next tokens start

    def logprobs(i: int, tokens: list[int], values: list[dict[int, float]] | None) -> dict | None:
        if req.logprobs is None or values is None:
            return None
        shaped = completion_logprobs(tokens, values, req.logprobs, state.decode, offsets[i])
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
                    usage=usage(outputs, req.n))

    return await respond(state, http, streams, req, base, make_chunk, make_body)


async def chat_completions(state: ServerState, req: ChatRequest, http: Request) -> Response | dict:
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    streams, tools, ids = await start_chat(state, req, top_n)
    readers = [reply_processor(state, ids, req, tools) for _ in streams]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id}

    def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
        """The choice's deltas: reasoning and prose as they come, tool calls as they complete (a named
        function's arguments as they come); the event's logprobs and finish reason ride on the last."""
        reader = readers[i]
        deltas = reader.feed(event.delta, event.finish_reason is not None)
        chunks = [dict(base, choices=[{"index": i, "delta": d, "finish_reason": None}]) for d in deltas or [{}]]
        if first:
            opening = "" if tools.mode in ("none", "auto") else None
            chunks.insert(0, dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": opening},
                                                  "finish_reason": None}]))
        last = chunks[-1]["choices"][0]
        last["finish_reason"] = reader.finish_reason(event.finish_reason)
        if top_n is not None:
            last["logprobs"] = chat_logprobs(event.token_ids, event.logprobs, top_n, state.decode)
        return chunks

    def make_body(outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            reply = readers[i].reply(out.text, out.finish_reason)
            message = {"role": "assistant", "content": reply.content}
            if state.reasoning_parser != "none":
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
            choice = {"index": i, "message": message, "finish_reason": reply.finish_reason}
            if top_n is not None:
                choice["logprobs"] = chat_logprobs(out.token_ids, out.logprobs, top_n, state.decode)
            choices.append(choice)
        return dict(base, object="chat.completion", choices=choices, usage=usage(outputs, req.n))

    return await respond(state, http, streams, req, base, make_chunk, make_body)


def register(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions on `app`."""

    @app.post("/v1/completions")
    async def completion_route(req: CompletionRequest, http: Request):
        return await completions(state, req, http)

    @app.post("/v1/chat/completions")
    async def chat_route(req: ChatRequest, http: Request):
        return await chat_completions(state, req, http)
