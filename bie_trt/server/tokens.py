"""The handlers of vLLM's POST /tokenize and /detokenize."""
from __future__ import annotations

import anyio
import jinja2
from fastapi import FastAPI

from ..errors import BieError
from .errors import ApiError
from .protocols.openai import DetokenizeRequest, TokenizeRequest
from .state import ServerState


async def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    """A prompt (or chat messages, through the template) -> its token ids."""
    engine = state.engine
    try:
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await anyio.to_thread.run_sync(engine.encode_chat, [m.to_template() for m in req.messages], tools,
                                                 req.chat_template_kwargs)
        else:
            ids = await anyio.to_thread.run_sync(engine.encode_text, req.prompt, req.add_special_tokens)
    except (jinja2.TemplateError, BieError) as e:
        raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    """Token ids -> their text."""
    vocab = state.engine.vocab_size
    if (bad := next((t for t in req.tokens if not 0 <= t < vocab), None)) is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab}).", "tokens")
    return {"prompt": await anyio.to_thread.run_sync(state.engine.tokenizer.decode, req.tokens)}


def register(app: FastAPI, state: ServerState) -> None:
    """vLLM's POST /tokenize and /detokenize on `app`."""

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await detokenize(state, req)
