"""The thread that runs an `EngineCore`: callers hand it work through a queue (requests to admit, aborts,
cache operations), it steps while there is work and posts each step's events to the requests' mailboxes.
Only this thread touches the core's scheduler, blocks and model."""
from __future__ import annotations

import queue
import threading
from typing import Callable

from .engine_core import EngineCore
from .mailbox import deliver
from .request_state import RequestState
from .streams import RequestStream


class EngineThread:
    def __init__(self, core: EngineCore):
        self.core = core
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()                    # guards starting and ending the thread
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread, between steps, in the order calls arrive. The thread is not a daemon:
        interpreter exit waits for the requests in flight (killing it inside torch aborts the process)."""
        self._inbox.put(fn)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="bie-engine-loop")
                self._thread.start()

    def call_and_wait(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread between steps and wait for it; its exception is raised here."""
        done, error = threading.Event(), []

        def run() -> None:
            try:
                fn()
            except Exception as e:   # handed to the caller, not to the requests in flight
                error.append(e)
            finally:
                done.set()

        self.call(run)
        done.wait()
        if error:
            raise error[0]

    def _loop(self) -> None:
        """Step while there is work; the thread ends when there is none (the next call starts another)."""
        core = self.core
        while True:
            try:
                while not self._inbox.empty():   # only this thread takes from the inbox
                    self._inbox.get()()
                if not core.has_work():
                    with self._lock:
                        if self._inbox.empty():
                            self._thread = None
                            return
                    continue
            except Exception as e:  # a bug outside any step: every request in flight gets the error
                self._post(core.fail(list(core.live.values()), e))
                continue
            self._post(core.step())

    @staticmethod
    def _post(events: list) -> None:
        deliver((request.events, item) for request, item in events)

    def submit(self, requests: list[RequestState]) -> list[RequestStream]:
        self.call(lambda: self.core.add(requests))   # one call: all are admitted in the same step
        return [RequestStream(self.abort, r) for r in requests]

    def abort(self, request: RequestState, wait: bool) -> None:
        """Abort on the loop thread. Without `wait` (a finaliser, which may run on any thread, even inside
        `call`) only the reentrant queue is touched: a request not done yet keeps the loop alive."""
        if request.done.is_set():
            return
        if wait:
            self.call(lambda: self.core.abort(request))
            request.done.wait()
        else:
            self._inbox.put(lambda: self.core.abort(request))
