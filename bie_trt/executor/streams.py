"""The thread-safe link between a caller and the engine loop: each request's event queue, and the
iterator over it that aborts the request when closed or dropped."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from .outputs import StreamEvent
from .sequence import Detokenizer, Sequence


@dataclass
class RequestState:
    """A request as the loop holds it: its sequence, its text so far, and the events its stream reads."""

    seq: Sequence
    detok: Detokenizer
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)   # set once its blocks are free


_CLOSED = object()   # wakes a reader blocked on a closed stream


class RequestStream:
    """One request's StreamEvents in order; the last carries its RequestOutput. Closing the stream (or
    dropping it) aborts the request; `close()` is safe from any thread, also while another waits in
    `next()`."""

    def __init__(self, abort: Callable[["RequestState", bool], None], request: RequestState):
        """`abort(request, wait)`: the engine's, which ends the request on its loop thread."""
        self._abort, self._request, self._done = abort, request, False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        item = self._request.events.get()
        if item is _CLOSED:
            raise StopIteration
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

    def __del__(self) -> None:
        # Dropped unclosed: abort without waiting, since a finaliser may run on any thread, even the loop's.
        if not self._done:
            self._abort(self._request, False)
