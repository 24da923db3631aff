"""A request's mailbox: the events the engine's loop thread posts for it, read by one reader. A thread
blocks on it; an asyncio task makes it hand its events to the task's event loop, so that from then on
the loop thread posts them onto that loop (`deliver`: one `call_soon_threadsafe` a loop per step) and no
thread waits per request or per event."""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable, Iterable


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
