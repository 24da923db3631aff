"""One HTTP request as it crosses from the ingress to a replica, and the replica side of it: the
request run through the replica's ASGI app (the single-process server's app), its ASGI messages
handed back one by one so that streamed responses stream through."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """The app's response messages (`http.response.start`, then the body's) for `request`. Closing the
    iterator early, as a client that leaves does, is the app's client disconnecting: it aborts the work."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query_string, "headers": request.headers, "client": request.client,
             "server": ("127.0.0.1", 0)}
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_taken = False

    async def receive() -> Message:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            messages.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task   # the app's own exception, if it raised one
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
