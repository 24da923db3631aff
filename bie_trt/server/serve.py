"""Run the app under uvicorn with a graceful stop: on SIGTERM or SIGINT it stops accepting connections,
lets in-flight requests finish for up to `grace_s` seconds, then aborts the rest (their KV blocks are
freed as their streams close) and returns, so the process exits 0, as service managers expect."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import uvicorn
from fastapi import FastAPI


class _GracefulServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its graceful shutdown, which ends the process with -SIGTERM;
        # a server asked to stop that stopped cleanly should report success instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", grace_s: float = 30.0) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s)
    _GracefulServer(config).run()
