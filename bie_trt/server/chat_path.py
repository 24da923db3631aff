"""The chat request path every API that speaks in messages shares (OpenAI's chat, Anthropic's Messages,
the Responses API): another API's body as a chat body, the prompt through the chat template with its
tools, the start on the engine, and the reader of its replies."""
from __future__ import annotations

from typing import Any, Callable

import jinja2
import pydantic

from ..chat.reply_processor import ReplyProcessor
from ..chat.tool_calls import CallCheck, ToolSetup
from ..errors import BieError
from ..executor.prompt_encoder import FinalMessageError
from ..executor.streams import RequestStream
from .errors import ApiError
from .generation import submit
from .protocols.openai import ChatRequest, describe_error
from .reply_format import ParamError, tool_setup
from .state import ServerState


def reply_processor(state: ServerState, prompt_ids: list[int], req: ChatRequest, tools: ToolSetup,
                    check: CallCheck | None = None) -> ReplyProcessor:
    """The reader of one reply to this chat body (BieEngine.reply_processor): not split for reasoning where an
    output constraint or tool_choice shapes the whole reply."""
    return state.engine.reply_processor(prompt_ids, tools, bool(req.constraints()), check)


def as_chat_request(fields: dict[str, Any]) -> ChatRequest:
    """Another API's body, converted to chat fields, as the chat body it stands for. The conversion
    only writes what the other API's own checks let through, so a failure here is still the client's."""
    try:
        return ChatRequest.model_validate(fields)
    except pydantic.ValidationError as e:
        message, param = describe_error(e.errors()[0])
        raise ApiError(400, message, param) from None


def chat_encoder(state: ServerState, req: ChatRequest) -> tuple[Callable[[], list[int]], ToolSetup]:
    """A chat body's prompt as a function that puts it through the chat template (tools rendered), to run
    in a worker thread, and how its tools shape the reply. Every API that speaks in messages (chat,
    Anthropic's Messages, the Responses API) comes through here."""
    messages = [m.to_template() for m in req.messages]
    try:
        tools = tool_setup(req)
    except ParamError as e:
        raise ApiError(400, str(e), e.param) from None
    if req.continue_final_message and (tools.mode not in ("none", "auto") or req.constraints()):
        raise ApiError(400, "continue_final_message with an output constraint (tool_choice required or a named "
                            "function, response_format, structured_outputs): a constraint shapes the whole reply, "
                            "not the rest of one begun; send one of them.", "continue_final_message")

    def encode() -> list[int]:
        try:
            return state.engine.encode_chat(messages, tools.tools, req.chat_template_kwargs,
                                            req.continue_final_message)
        except FinalMessageError as e:
            raise ApiError(400, str(e), "continue_final_message") from None
        except (jinja2.TemplateError, BieError) as e:   # e.g. a template that insists on alternating roles
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from None

    return encode, tools


async def chat_prompt(state: ServerState, req: ChatRequest) -> tuple[list[int], ToolSetup]:
    """A chat body's prompt (counted, not started) and how its tools shape the reply."""
    encode, tools = chat_encoder(state, req)
    return await state.prepare(encode), tools


async def start_chat(state: ServerState, req: ChatRequest, top_n: int | None = None
                     ) -> tuple[list[RequestStream], ToolSetup, list[int]]:
    """A chat body started on the engine, encoded and started in one worker thread: its n streams, its
    tool plan (each stream's ReplyParser comes from it) and its prompt."""
    encode, tools = chat_encoder(state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    streams, prompts = await submit(state, lambda: [encode()], 1, req, max_tokens, top_n, chat=True, tools=tools)
    return streams, tools, prompts[0]
