"""What the ingress routes a request by: the token ids its replica will prefill, read from the body."""
from __future__ import annotations

from ..executor.prompt_encoder import PromptEncoder
from ..server.protocol import CacheRequest, ChatRequest
from ..server.structured import tool_plan


def routed_prompt(path: str, body: dict, encoder: PromptEncoder) -> list[int] | None:
    """The token ids the replica will prefill for this body (None: no prompt to route by). Only what the
    router needs: the first prompt of a batch; a chat's messages and tools through the template."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return encoder.encode(prompt)
    if path == "/v1/chat/completions":
        chat = ChatRequest.model_validate(body)
        return encoder.encode_chat([m.to_template() for m in chat.messages], tool_plan(chat).tools,
                                   chat.chat_template_kwargs)
    if path in ("/v1/cache/save", "/v1/cache/restore"):
        cache = CacheRequest.model_validate(body)
        if cache.messages is not None:
            return encoder.encode([m.to_template() for m in cache.messages], chat=True)
        return encoder.encode(cache.prompt) if cache.prompt is not None else None
    return None
