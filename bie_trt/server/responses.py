"""The handlers of OpenAI's Responses API: POST /v1/responses (the body converted once into the chat
request (responses_protocol), run on the chat route's request path, the reply's blocks (a thinking
model's reasoning split off as the chat route splits it) rendered as output items, whole or as the
API's typed, numbered events), GET and DELETE /v1/responses/{id} over
the stored responses that `previous_response_id` continues."""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..executor.outputs import RequestOutput, StreamEvent
from .blocks import REASONING, TEXT, Block, BlockEvent, BlockStream, assistant_message, reply_blocks
from .completions import as_chat_request, reasoning_start, start_chat
from .errors import ApiError, error_body
from .generation import Wire, respond, typed_sse
from .response_store import StoredResponse
from .responses_protocol import ResponsesRequest, ToolChoiceFunction, input_messages
from .state import ServerState


def numbered_wire() -> Wire:
    """The Responses stream: typed events, each with its sequence_number; an error is an `error` event."""
    numbers = itertools.count()

    def frame(event: dict) -> str:
        return typed_sse({**event, "sequence_number": next(numbers)})

    return Wire(frame=frame, done="", error=lambda status, message: {"type": "error", **error_body(status, message)})


def output_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


# The blocks with text parts: their part, and the prefix of their text events.
PARTS = {TEXT: (output_part, "response.output_text"), REASONING: (reasoning_part, "response.reasoning_text")}
ID_PREFIX = {TEXT: "msg", REASONING: "rs"}


def usage(out: RequestOutput) -> dict:
    u = out.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class Rendering:
    """One response's output items and events, named after its id."""

    def __init__(self, response_id: str):
        self.key = response_id.removeprefix("resp_")

    def item_id(self, block: Block) -> str:
        return f"{ID_PREFIX.get(block.kind, 'fc')}_{self.key}{block.index:03d}"

    def item(self, block: Block, status: str, opening: bool = False) -> dict:
        """The block as an output item (`opening`: as it is announced, before its text)."""
        if block.kind == TEXT:
            return {"type": "message", "id": self.item_id(block), "status": status, "role": "assistant",
                    "content": [] if opening else [output_part(block.text)]}
        if block.kind == REASONING:
            return {"type": "reasoning", "id": self.item_id(block), "status": status, "summary": [],
                    "content": [] if opening else [reasoning_part(block.text)]}
        return {"type": "function_call", "id": self.item_id(block), "call_id": block.call_id, "name": block.name,
                "arguments": "" if opening else block.text, "status": status}

    def events(self, event: BlockEvent, status: str) -> list[dict]:
        block = event.block
        at = {"item_id": self.item_id(block), "output_index": block.index}
        part, prefix = PARTS.get(block.kind, (None, ""))
        logprobs = {"logprobs": []} if block.kind == TEXT else {}
        if event.what == "start":
            added = [{"type": "response.output_item.added", "output_index": block.index,
                      "item": self.item(block, "in_progress", opening=True)}]
            if part is not None:
                added.append({"type": "response.content_part.added", **at, "content_index": 0, "part": part("")})
            return added
        if event.what == "delta":
            if part is not None:
                return [{"type": f"{prefix}.delta", **at, "content_index": 0, "delta": event.delta, **logprobs}]
            return [{"type": "response.function_call_arguments.delta", **at, "delta": event.delta}]
        if part is not None:
            done = [{"type": f"{prefix}.done", **at, "content_index": 0, "text": block.text, **logprobs},
                    {"type": "response.content_part.done", **at, "content_index": 0, "part": part(block.text)}]
        else:
            done = [{"type": "response.function_call_arguments.done", **at, "name": block.name,
                     "arguments": block.text}]
        return done + [{"type": "response.output_item.done", "output_index": block.index,
                        "item": self.item(block, status)}]


def previous_conversation(state: ServerState, response_id: str | None) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    stored = state.responses.get(response_id)
    if stored is None:
        raise ApiError(400, f"previous response {response_id!r} is not stored here: this server keeps the "
                            f"{state.responses.capacity} most recent responses sent with store true, in memory, "
                            f"until it restarts; send the conversation as input instead.", "previous_response_id")
    return stored.conversation


async def create_response(state: ServerState, req: ResponsesRequest, http: Request) -> Response | dict:
    history = previous_conversation(state, req.previous_response_id)
    chat = as_chat_request(req.chat_fields(history))
    streams, tools, ids = await start_chat(state, chat)
    parser = tools.parser()
    inside = reasoning_start(state, ids, chat, tools)
    response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    rendering = Rendering(response_id)
    conversation = history + input_messages(req.input)
    text_format = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, ToolChoiceFunction) else req.tool_choice
    base = {"id": response_id, "object": "response", "created_at": created, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.model_id,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store, "temperature": req.temperature,
            "top_p": req.top_p, "truncation": "disabled", "metadata": req.metadata or {},
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []]}

    def status_of(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def finished(out: RequestOutput, blocks: list[Block]) -> dict:
        """The response's final body, stored when asked to be."""
        status = status_of(out.finish_reason)
        body = {**base, "status": status, "output": [rendering.item(b, status) for b in blocks], "usage": usage(out),
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        if req.store:
            state.responses.put(response_id, StoredResponse(body, conversation + [assistant_message(blocks)]))
        return body

    def make_body(outputs: list[RequestOutput]) -> dict:
        return finished(outputs[0], reply_blocks(parser, outputs[0].text, inside))

    stream = BlockStream(parser, inside)

    def make_chunk(event: StreamEvent, i: int, first: bool) -> list[dict]:
        chunks = []
        if first:
            opening = {**base, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
            chunks += [{"type": "response.created", "response": opening},
                       {"type": "response.in_progress", "response": opening}]
        final = event.output is not None
        status = status_of(event.finish_reason)
        for block_event in stream.feed(event.delta, final):
            chunks += rendering.events(block_event, status)
        if final:
            body = finished(event.output, stream.blocks)
            chunks.append({"type": f"response.{body['status']}", "response": body})
        return chunks

    return await respond(state, http, streams, chat, {}, make_chunk, make_body, numbered_wire())


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response {response_id!r} (this server keeps the "
                            f"{state.responses.capacity} most recent, in memory).", "response_id")
    return stored


async def get_response(state: ServerState, response_id: str) -> dict:
    return _stored(state, response_id).body


async def delete_response(state: ServerState, response_id: str) -> dict:
    _stored(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
