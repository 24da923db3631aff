"""The handlers of Anthropic's POST /v1/messages and /v1/messages/count_tokens: the body converted once
into the chat request (protocols/anthropic.py), run on the chat route's request path, and the reply's
blocks (a thinking model's reasoning split off as the chat route splits it) rendered as Anthropic's
content blocks, whole or as its stream of typed events."""
from __future__ import annotations

import uuid
from typing import Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..executor.outputs import RequestOutput, StreamEvent
from .reply_blocks import REASONING, TEXT, TOOL_CALL, Block, BlockEvent, BlockStream, call_input, reply_blocks
from .chat_path import as_chat_request, chat_prompt, reply_processor, start_chat
from .errors import anthropic_error_body
from .generation import Wire, respond, typed_sse
from .protocols.anthropic import CountTokensRequest, MessagesRequest, MessagesBody
from .state import ServerState

ANTHROPIC_WIRE = Wire(frame=typed_sse, done="", error=anthropic_error_body)
Body = TypeVar("Body", bound=MessagesBody)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_block(block: Block, omitted: bool = False) -> dict:
    """A finished block as Anthropic's: thinking (unsigned: nothing here checks a signature; empty when the
    request's thinking `display` is "omitted"), text, or tool_use (its input an object; a call cut short
    by max_tokens, whose arguments are no object yet, is sent as the text it is)."""
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "" if omitted else block.text, "signature": ""}
    if block.kind == TEXT or (arguments := call_input(block)) is None:
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name, "input": arguments}


def stream_events(event: BlockEvent, omitted: bool = False) -> list[dict]:
    """One block event as Anthropic's content_block_start / _delta / _stop (a thinking block's deltas left
    out when its display is "omitted")."""
    block = event.block
    if event.what == "start":
        opening = {REASONING: {"type": "thinking", "thinking": "", "signature": ""},
                   TEXT: {"type": "text", "text": ""},
                   TOOL_CALL: {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name, "input": {}}}
        return [{"type": "content_block_start", "index": block.index, "content_block": opening[block.kind]}]
    if event.what == "delta":
        if omitted and block.kind == REASONING:
            return []
        delta = {REASONING: {"type": "thinking_delta", "thinking": event.delta},
                 TEXT: {"type": "text_delta", "text": event.delta},
                 TOOL_CALL: {"type": "input_json_delta", "partial_json": event.delta}}
        return [{"type": "content_block_delta", "index": block.index, "delta": delta[block.kind]}]
    return [{"type": "content_block_stop", "index": block.index}]


def stop_sequence(out: RequestOutput, stops: list[str], decode: Callable[[list[int]], str]) -> str | None:
    """The stop sequence that ended the reply: the output's text is cut just before it, its tokens are not."""
    if out.finish_reason != "stop" or not stops:
        return None
    rest = decode(out.token_ids)[len(out.text):]
    return next((s for s in stops if rest.startswith(s)), None)


def called(blocks: list[Block]) -> bool:
    return any(b.kind == TOOL_CALL for b in blocks)


def stop_reason(finish_reason: str | None, called: bool, sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if sequence is not None else "end_turn"


def anthropic_usage(out: RequestOutput) -> dict:
    """Anthropic counts the prompt's tokens read from the cache apart from the others."""
    cached = out.usage.cached_tokens
    return {"input_tokens": out.usage.prompt_tokens - cached, "output_tokens": out.usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def prompt_tokens(state: ServerState, req: MessagesBody) -> int:
    ids, _ = await chat_prompt(state, as_chat_request(req.chat_fields()))
    return len(ids)


async def edit_context(state: ServerState, req: Body) -> tuple[Body, dict | None, int | None]:
    """The request with its context_management edits applied in order, each measured on the prompt it
    makes: (the edited request, the response's context_management, the prompt's tokens before any edit);
    (req, None, None) when it asks for none."""
    if req.context_management is None:
        return req, None, None
    original = tokens = await prompt_tokens(state, req)
    applied = []
    for edit in req.context_management.edits:
        messages, count = edit.edit(req.messages, tokens)
        if not count:
            continue
        edited = req.model_copy(update={"messages": messages})
        after = await prompt_tokens(state, edited)
        least = getattr(edit, "clear_at_least", None)
        if least is not None and tokens - after < least.value:   # not worth breaking the cached prefix for
            continue
        applied.append(edit.report(count, tokens - after))
        req, tokens = edited, after
    return req, {"applied_edits": applied}, original


async def messages(state: ServerState, req: MessagesRequest, http: Request) -> Response | dict:
    req, context_management, _ = await edit_context(state, req)
    chat = as_chat_request(req.chat_fields())
    streams, tools, ids = await start_chat(state, chat)
    reader = reply_processor(state, ids, chat, tools)

    def decode(tokens: list[int]) -> str:
        return state.engine.tokenizer.decode(tokens, skip_special_tokens=True)

    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": state.model_id}
    edits = {} if context_management is None else {"context_management": context_management}

    def ending(out: RequestOutput, has_calls: bool) -> dict:
        sequence = stop_sequence(out, req.stop_sequences or [], decode)
        return {"stop_reason": stop_reason(out.finish_reason, has_calls, sequence), "stop_sequence": sequence}

    def make_body(outputs: list[RequestOutput]) -> dict:
        out = outputs[0]
        blocks = reply_blocks(reader, out.text)
        return {**message, "content": [content_block(b, req.thinking_omitted) for b in blocks],
                **ending(out, called(blocks)),
                "usage": anthropic_usage(out), **edits}

    stream = BlockStream(reader)

    def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
        chunks = []
        if first:
            chunks.append({"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
        final = event.output is not None
        for block_event in stream.feed(event.delta, final):
            chunks += stream_events(block_event, req.thinking_omitted)
        if final:
            chunks += [{"type": "message_delta", "delta": ending(event.output, called(stream.blocks)),
                        "usage": anthropic_usage(event.output), **edits},
                       {"type": "message_stop"}]
        return chunks

    return await respond(state, http, streams, chat, {}, make_chunk, make_body, ANTHROPIC_WIRE)


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict:
    """The prompt's tokens as /v1/messages would send them to the model (tools rendered, context edits
    applied, with the count before them as Anthropic reports it)."""
    req, context_management, original = await edit_context(state, req)
    counted = {"input_tokens": await prompt_tokens(state, req)}
    return counted if context_management is None else {**counted, "context_management": {
        "original_input_tokens": original}}


def register(app: FastAPI, state: ServerState) -> None:
    """Anthropic's POST /v1/messages and /v1/messages/count_tokens on `app`."""

    @app.post("/v1/messages")
    async def messages_route(req: MessagesRequest, http: Request):
        return await messages(state, req, http)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(req: CountTokensRequest):
        return await count_tokens(state, req)
