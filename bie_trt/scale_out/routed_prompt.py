"""What the ingress routes a request by: the token ids its replica will prefill, read from the body."""
from __future__ import annotations

from ..executor.prompt_encoder import PromptEncoder
from ..server.protocols.anthropic import MessagesRequest
from ..server.protocols.openai import CacheRequest, ChatRequest
from ..server.protocols.openai_responses import ResponsesRequest
from ..server.reply_format import tool_setup


CHAT_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


def routed_prompt(path: str, body: dict, encoder: PromptEncoder) -> list[int] | None:
    """The token ids the replica will prefill for this body (None: no prompt to route by). Only what the
    router needs: the first prompt of a batch; a chat's messages and tools through the template."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return encoder.encode(prompt)
    if path in CHAT_PATHS:
        chat = chat_body(path, body)
        return None if chat is None else encoder.encode_chat(
            [m.to_template() for m in chat.messages], tool_setup(chat).tools, chat.chat_template_kwargs,
            chat.continue_final_message)
    if path in ("/v1/cache/save", "/v1/cache/restore"):
        cache = CacheRequest.model_validate(body)
        if cache.messages is not None:
            return encoder.encode([m.to_template() for m in cache.messages], chat=True)
        return encoder.encode(cache.prompt) if cache.prompt is not None else None
    return None


def chat_body(path: str, body: dict) -> ChatRequest | None:
    """The chat body a chat, Messages or Responses body stands for, as its replica converts it. None for
    a Responses body that continues a stored response: its history is in the storing replica's memory."""
    if path == "/v1/messages":
        return ChatRequest.model_validate(MessagesRequest.model_validate(body).chat_fields())
    if path == "/v1/responses":
        responses = ResponsesRequest.model_validate(body)
        return None if responses.previous_response_id else ChatRequest.model_validate(responses.chat_fields([]))
    return ChatRequest.model_validate(body)
