"""The handlers of OpenAI's Responses API: POST /v1/responses (the body converted once into the chat
request (protocols/openai_responses.py), run on the chat route's request path, the reply's blocks (a thinking
model's reasoning split off as the chat route splits it) rendered as output items (messages, reasoning,
function, custom-tool and local-shell calls: responses_tools), whole or as the API's typed, numbered
events), GET and DELETE /v1/responses/{id} over the stored responses that `previous_response_id`
continues. Reasoning is sealed for stateless clients (`include: ["reasoning.encrypted_content"]`) and
opened when they send it back (sealing)."""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ..chat.tool_calls import new_call_id
from ..errors import RequestError
from ..executor.outputs import RequestOutput, StreamEvent
from .reply_blocks import REASONING, TEXT, TOOL_CALL, Block, BlockEvent, BlockStream, assistant_message, reply_blocks
from .chat_path import as_chat_request, reply_processor, start_chat
from .errors import ApiError, error_body
from .generation import Wire, respond, typed_sse
from .protocols.openai_responses import ReasoningText, ResponsesRequest, input_messages
from .response_store import StoredResponse
from .responses_tools import LOCAL_SHELL, Toolbox, call_input, shell_action
from .sealing import ReasoningSeal, SealError
from .state import ServerState

CUSTOM = "custom"


def numbered_wire(base: dict) -> Wire:
    """The Responses stream: typed events, each with its sequence_number. A failure once the stream has
    begun ends it with `response.failed` (the response, `status` failed, its `error`: what Codex reads);
    before, it is an `error` body."""
    numbers = itertools.count()

    def frame(event: dict) -> str:
        return typed_sse({**event, "sequence_number": next(numbers)})

    def failed(status: int, message: str) -> dict:
        error = {"code": "timeout" if status == 408 else "server_error", "message": message}
        return {"type": "response.failed", "response": {**base, "status": "failed", "output": [], "usage": None,
                                                        "incomplete_details": None, "error": error}}

    return Wire(frame=frame, done="", error=lambda status, message: {"type": "error", **error_body(status, message)},
                failed=failed)


def output_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def summary_part(text: str) -> dict:
    return {"type": "summary_text", "text": text}


# The blocks with text parts: their part, and the prefix of their text events.
PARTS = {TEXT: (output_part, "response.output_text"), REASONING: (reasoning_part, "response.reasoning_text")}
ID_PREFIX = {TEXT: "msg", REASONING: "rs", "function": "fc", CUSTOM: "ctc", LOCAL_SHELL: "lsh"}


def usage(out: RequestOutput) -> dict:
    u = out.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class Rendering:
    """One response's output items and events, named after its id. `box`: the request's tools (what a
    call of each name is); `forced`: the custom tool tool_choice names, whose input is the whole reply;
    `summarised`: the reasoning is also its summary; `seal`: reasoning items carry it sealed."""

    def __init__(self, response_id: str, box: Toolbox, forced: str | None = None, summarised: bool = False,
                 seal: ReasoningSeal | None = None):
        self.key = response_id.removeprefix("resp_")
        self.box, self.forced, self.summarised, self.seal = box, forced, summarised, seal
        self.forced_call_id = new_call_id() if forced else ""
        self._sealed: dict[int, str] = {}

    def kind(self, block: Block) -> str:
        """TEXT, REASONING, or what a call is: function, custom or local_shell."""
        if block.kind == TEXT and self.forced:
            return CUSTOM
        return self.box.kind(block.name) if block.kind == TOOL_CALL else block.kind

    def item_id(self, block: Block) -> str:
        return f"{ID_PREFIX[self.kind(block)]}_{self.key}{block.index:03d}"

    def as_call(self, block: Block) -> Block:
        """A forced custom tool's reply as the call it is (how a stored conversation replays it)."""
        if self.kind(block) == CUSTOM and block.kind == TEXT:
            return Block(TOOL_CALL, block.index, json.dumps({"input": block.text}, ensure_ascii=False),
                         self.forced_call_id, self.forced)
        return block

    def sealed(self, block: Block) -> str:
        """The block's reasoning sealed once (each seal has its own nonce: one text per item)."""
        if block.index not in self._sealed:
            self._sealed[block.index] = self.seal.seal(block.text)
        return self._sealed[block.index]

    def item(self, block: Block, status: str, opening: bool = False) -> dict:
        """The block as an output item (`opening`: as it is announced, before its text)."""
        kind, item_id = self.kind(block), self.item_id(block)
        if kind == TEXT:
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": [] if opening else [output_part(block.text)]}
        if kind == REASONING:
            item = {"type": "reasoning", "id": item_id, "status": status,
                    "summary": [summary_part(block.text)] if self.summarised and not opening else [],
                    "content": [] if opening else [reasoning_part(block.text)]}
            if self.seal is not None:
                item["encrypted_content"] = None if opening else self.sealed(block)
            return item
        call = self.as_call(block)
        if kind == CUSTOM:
            return {"type": "custom_tool_call", "id": item_id, "call_id": call.call_id, "name": call.name,
                    "input": "" if opening else call_input(call.text), "status": status}
        if kind == LOCAL_SHELL:
            return {"type": "local_shell_call", "id": item_id, "call_id": call.call_id, "status": status,
                    "action": shell_action(call.text)}
        return {"type": "function_call", "id": item_id, "call_id": call.call_id, **self.box.call_name(call.name),
                "arguments": "" if opening else call.text, "status": status}

    def events(self, event: BlockEvent, status: str) -> list[dict]:
        block, kind = event.block, self.kind(event.block)
        at = {"item_id": self.item_id(block), "output_index": block.index}
        done = {"type": "response.output_item.done", "output_index": block.index, "item": self.item(block, status)} \
            if event.what == "stop" else None
        if kind == LOCAL_SHELL:   # no deltas of its own: announced and done once its action is whole
            added = {"type": "response.output_item.added", "output_index": block.index,
                     "item": self.item(block, "in_progress")}
            return [added, done] if done else []
        if event.what == "start":
            added = [{"type": "response.output_item.added", "output_index": block.index,
                      "item": self.item(block, "in_progress", opening=True)}]
            if kind in PARTS:
                added.append({"type": "response.content_part.added", **at, "content_index": 0,
                              "part": PARTS[kind][0]("")})
            if kind == REASONING and self.summarised:
                added.append({"type": "response.reasoning_summary_part.added", **at, "summary_index": 0,
                              "part": summary_part("")})
            return added
        if kind == CUSTOM:
            # a forced tool's input streams as the model writes it; a call in a free reply is whole at its end
            if event.what == "delta":
                return [{"type": "response.custom_tool_call_input.delta", **at, "delta": event.delta}] \
                    if block.kind == TEXT else []
            whole = self.item(block, status)["input"]
            streamed = [] if block.kind == TEXT else [{"type": "response.custom_tool_call_input.delta", **at,
                                                       "delta": whole}]
            return streamed + [{"type": "response.custom_tool_call_input.done", **at, "input": whole}, done]
        if kind == "function":
            if event.what == "delta":
                return [{"type": "response.function_call_arguments.delta", **at, "delta": event.delta}]
            return [{"type": "response.function_call_arguments.done", **at, **self.box.call_name(block.name),
                     "arguments": block.text}, done]
        part, prefix = PARTS[kind]
        logprobs = {"logprobs": []} if kind == TEXT else {}
        summary = kind == REASONING and self.summarised
        if event.what == "delta":
            return [{"type": f"{prefix}.delta", **at, "content_index": 0, "delta": event.delta, **logprobs}] + \
                ([{"type": "response.reasoning_summary_text.delta", **at, "summary_index": 0, "delta": event.delta}]
                 if summary else [])
        closing = [{"type": f"{prefix}.done", **at, "content_index": 0, "text": block.text, **logprobs},
                   {"type": "response.content_part.done", **at, "content_index": 0, "part": part(block.text)}]
        if summary:
            closing += [{"type": "response.reasoning_summary_text.done", **at, "summary_index": 0, "text": block.text},
                        {"type": "response.reasoning_summary_part.done", **at, "summary_index": 0,
                         "part": summary_part(block.text)}]
        return closing + [done]


def open_sealed(state: ServerState, req: ResponsesRequest) -> None:
    """Each sealed reasoning item of the input opened in place: its sealed text is what the template gets.
    One that does not open (altered, or sealed under another key) is a 400 naming it."""
    for i, item in enumerate(req.input):
        if item.type != "reasoning" or not item.encrypted_content:
            continue
        try:
            text = state.seal.open(item.encrypted_content)
        except SealError as e:
            raise ApiError(400, f"input[{i}].encrypted_content is refused: {e}. Send the reasoning item back as "
                                f"this server returned it, or leave it out.", f"input[{i}].encrypted_content") from None
        req.input[i] = item.model_copy(update={"content": [ReasoningText(type="reasoning_text", text=text)],
                                               "encrypted_content": None})


def check_grammars(state: ServerState, req: ResponsesRequest) -> None:
    """Each custom tool's grammar compiled now (cached), so a bad one is a 400 naming it before generation."""
    for i, tool in enumerate(req.tools or []):
        spec = tool.constraint() if tool.type == CUSTOM else None
        if spec is not None:
            try:
                state.engine.grammar_compiler().compile(spec)
            except RequestError as e:
                raise ApiError(400, f"tools[{i}].format.definition: {e}", f"tools[{i}].format.definition") from None


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
    box = req.toolbox()
    check_grammars(state, req)
    open_sealed(state, req)
    history = previous_conversation(state, req.previous_response_id)
    chat = as_chat_request(req.chat_fields(history))
    streams, tools, ids = await start_chat(state, chat)
    checked = box.custom or box.local_shell
    reader = reply_processor(state, ids, chat, tools,
                             box.check(state.engine.grammar_compiler().accepts) if checked else None)
    response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    forced = req.forced_custom
    sealing = "reasoning.encrypted_content" in (req.include or [])
    rendering = Rendering(response_id, box, forced.name if forced else None,
                          req.reasoning is not None and req.reasoning.summarised, state.seal if sealing else None)
    conversation = history + input_messages(req.input)
    text_format = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
    reasoning = req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}
    base = {"id": response_id, "object": "response", "created_at": created, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.model_id,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store, "temperature": req.temperature,
            "top_p": req.top_p, "truncation": "disabled", "metadata": req.metadata or {},
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}, "verbosity": req.text.verbosity if req.text else None},
            "reasoning": reasoning, "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tools_not_offered": box.not_offered()}

    def status_of(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def finished(out: RequestOutput, blocks: list[Block]) -> dict:
        """The response's final body, stored when asked to be."""
        status = status_of(out.finish_reason)
        body = {**base, "status": status, "output": [rendering.item(b, status) for b in blocks], "usage": usage(out),
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        if req.store:
            replay = assistant_message([rendering.as_call(b) for b in blocks])
            state.responses.put(response_id, StoredResponse(body, conversation + [replay]))
        return body

    def make_body(outputs: list[RequestOutput]) -> dict:
        return finished(outputs[0], reply_blocks(reader, outputs[0].text))

    stream = BlockStream(reader)

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

    return await respond(state, http, streams, chat, {}, make_chunk, make_body, numbered_wire(base))


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


def register(app: FastAPI, state: ServerState) -> None:
    """OpenAI's POST /v1/responses, GET and DELETE /v1/responses/{id} on `app`."""

    @app.post("/v1/responses")
    async def responses_route(req: ResponsesRequest, http: Request):
        return await create_response(state, req, http)

    @app.get("/v1/responses/{response_id}")
    async def response_get(response_id: str):
        return await get_response(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def response_delete(response_id: str):
        return await delete_response(state, response_id)
