"""The thread-safe link between a caller and the engine loop: each request's mailbox of events, and the
iterator over it (plain or async) that aborts the request when closed or dropped.

A mailbox is read by one reader. A thread blocks on it (`RequestStream.__next__`); an asyncio task makes it
hand its events to the task's event loop (`async for`): from then on the engine thread posts them onto the
loop (`deliver`: one `call_soon_threadsafe` a loop per step), so no thread waits per request or per event."""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import TYPE_CHECKING, Callable, Iterable

from .outputs import StreamEvent

if TYPE_CHECKING:
    from .request_state import RequestState


class Mailbox:
    """One request's events in order: a deque with a condition for a thread, or an asyncio.Queue once an
    async reader took it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: collections.deque = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None

    def post(self, item: object) -> tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None:
        """Hand over `item` to a thread reader, or -> (loop, queue) where the caller must put it (`deliver`)."""
        with self._lock:
            if self._queue is None:
                self._items.append(item)
                self._ready.notify()
                return None
            return self._loop, self._queue

    def put(self, item: object) -> None:
        deliver([(self, item)])

    def get(self) -> object:
        with self._lock:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    async def aget(self) -> object:
        if self._queue is None:
            with self._lock:   # from now on items go to this loop, after the ones already here
                self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
                for item in self._items:
                    self._queue.put_nowait(item)
                self._items.clear()
        return await self._queue.get()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    """`fn(*args)` on `loop`'s thread, from any thread; nothing once the loop closed (no reader is left)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def deliver(events: Iterable[tuple[Mailbox, object]]) -> None:
    """Post each (mailbox, item) in order: thread readers are woken at once, async readers' items go to their
    event loop in one call a loop (a loop that closed has no reader left to tell)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for mailbox, item in events:
        target = mailbox.post(item)
        if target is not None:
            by_loop.setdefault(target[0], []).append((target[1], item))
    for loop, items in by_loop.items():
        call_in_loop(loop, _put_all, items)


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
