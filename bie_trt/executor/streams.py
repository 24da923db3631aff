"""The thread-safe link between a caller and the engine loop: the iterator (plain or async) over a request's
mailbox (`mailbox.py`), which aborts the request when closed or dropped."""
from __future__ import annotations

import asyncio
from typing import Callable

from .mailbox import call_in_loop
from .outputs import StreamEvent
from .request_state import RequestState

_CLOSED = object()   # wakes a reader blocked on a closed stream


class RequestStream:
    """One request's StreamEvents in order, by `for` or `async for`; the last carries its RequestOutput.
    Closing the stream (or dropping it) aborts the request; `close()` is safe from any thread, also while
    another waits in `next()`; `aclose()` is its form for a task, which waits without a thread."""

    def __init__(self, abort: Callable[["RequestState", bool], None], request: RequestState):
        """`abort(request, wait)`: the engine's, which ends the request on its loop thread."""
        self._abort, self._request, self._done = abort, request, False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        event = self._take(self._request.events.get())
        if event is None:
            raise StopIteration
        return event

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        event = self._take(await self._request.events.aget())
        if event is None:
            raise StopAsyncIteration
        return event

    def _take(self, item: object) -> StreamEvent | None:
        if item is _CLOSED:
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.output is not None
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self._request, True)
            self._request.events.put(_CLOSED)

    async def aclose(self) -> None:
        """Abort the request and wait, in the event loop, until its blocks are free."""
        if self._done:
            return
        self._done = True
        loop, freed = asyncio.get_running_loop(), asyncio.Event()
        if self._request.on_finish(lambda: call_in_loop(loop, freed.set)):
            self._abort(self._request, False)   # an unfinished request keeps the loop thread running
            await freed.wait()

    def __del__(self) -> None:
        # Dropped unclosed: abort without waiting, since a finaliser may run on any thread, even the loop's.
        if not self._done:
            self._abort(self._request, False)
