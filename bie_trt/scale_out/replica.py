"""The replica deployment: one engine and the single-process server's app around it, served to the
ingress through Ray Serve (each HTTP request as a stream of ASGI messages)."""
from __future__ import annotations

import dataclasses
import os
from typing import AsyncIterator

import anyio
from ray import serve
from starlette.types import Message

from ..config import EngineConfig
from .affinity import RouteHint
from .asgi import ForwardedRequest, run_asgi


class BieReplica:
    async def __init__(self, config: EngineConfig, options, threads: int | None = None):
        import torch

        from ..executor.engine import BieEngine
        from ..server.app import create_app

        if threads is not None:   # replicas sharing one machine's cores share them out, not fight over them
            torch.set_num_threads(threads)
        if config.device.startswith("cuda"):   # Ray shows this process only the GPU it was given
            config = dataclasses.replace(config, device="cuda")
        engine = await anyio.to_thread.run_sync(BieEngine, config)
        self.app = create_app(engine, options)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def http(self, request: ForwardedRequest, route: RouteHint | None = None) -> AsyncIterator[Message]:
        """The app's response to `request`, message by message (`route` is the router's, unused here)."""
        async for message in run_asgi(self.app, request):
            yield message

    async def metrics(self, route: RouteHint | None = None) -> tuple[str, int, str]:
        """(this replica's id, its process id, its GET /metrics text)."""
        body = b""
        async for message in run_asgi(self.app, ForwardedRequest("GET", "/metrics", b"", [], b"")):
            body += message.get("body", b"")
        return self.replica, os.getpid(), body.decode()
