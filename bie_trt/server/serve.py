"""Run the app under uvicorn with a graceful stop: on SIGTERM or SIGINT it stops accepting connections,
lets in-flight requests finish for up to `grace_s` seconds, then aborts the rest (their KV blocks are
freed as their streams close) and returns, so the process exits 0, as service managers expect."""
from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from typing import Iterator

import uvicorn
from fastapi import FastAPI

from ..errors import BieError


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


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before the engine loads: a port in use fails at once, not after it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise BieError(f"--host {host}: not an address this machine can listen on ({e.strerror}); "
                       f"use an IP address such as 127.0.0.1 or 0.0.0.0.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn does: a restart may reuse it
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BieError(f"port {port} on {host} is already in use; stop what listens there or pick another "
                           f"--port.") from None
        raise BieError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --host or --port.") from None
    return sock


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", grace_s: float = 30.0,
          sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM/SIGINT, on `sock` when the caller bound it already (see `bind`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s)
    _GracefulServer(config).run(sockets=None if sock is None else [sock])
