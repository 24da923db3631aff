"""The bound checked before any work: the request body's size (413 before it is parsed). The body size is
sized from the context, which bounds the text any prompt is tokenised from; the prompt itself is measured
against the context once, on its token ids, by the engine."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

# Body bytes allowed per token of context: text is ~4 bytes a token, JSON-escaped text up to 6 a
# character, token ids ~7 with their separator; the rest is room for a batch of prompts and the fields.
REQUEST_BYTES_PER_TOKEN = 64
REQUEST_BYTES_FLOOR = 2**20


def default_max_request_bytes(max_model_len: int) -> int:
    return REQUEST_BYTES_FLOOR + REQUEST_BYTES_PER_TOKEN * max_model_len


def too_large(size: int, limit: int, path: str, exact: bool = True):
    what = f"{size:,} bytes" if exact else f"more than {limit:,} bytes"
    return error_response(413, f"the request body is {what}, above this server's --max-request-bytes {limit:,}; "
                             f"send a shorter prompt, or start the server with a larger --max-request-bytes.",
                        code="request_too_large", path=path)


class BodySizeLimit:
    """413 for a body above `limit` bytes: at once when Content-Length says so, else as soon as the bytes
    received pass it. A body within the limit is buffered and handed on unchanged."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(int(declared), self.limit, scope["path"])(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left: let the app see it
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await too_large(size, self.limit, scope["path"], exact=False)(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)
