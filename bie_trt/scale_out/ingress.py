"""The scale-out endpoint: an ASGI app in the `bie-trt serve` process that forwards each request to a
replica through the deployment's handle (so through its router), streaming the replica's response back
as it comes. It reads the prompt only to route by it: its leading token ids, encoded exactly as the
replica's engine encodes them. /metrics is its own: every replica's scrape, labelled, and the router's.

A replica that dies costs only the requests it was serving: before the response began they get a 503
(OpenAI's shape, with Retry-After); a stream already under way ends with that error as its last event.
"""
from __future__ import annotations

import asyncio
import json
import logging

import anyio
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send

from ..executor.prompt_encoder import PromptEncoder
from ..server.errors import ANTHROPIC_PREFIX, anthropic_error_body, error_body, error_response
from ..server.generation import typed_sse
from ..server.metrics import CONTENT_TYPE
from .affinity import MAX_BLOCKS, RouteHint
from .asgi import ForwardedRequest
from .metrics import ingress_metrics, labelled, render
from .routed_prompt import routed_prompt
from .router import router_of

log = logging.getLogger("bie_trt.scale_out")

RETRY_AFTER_S = 1
GONE_CODE = "replica_unavailable"
SCRAPE_TIMEOUT_S = 5.0          # a replica slower than this to answer a scrape is left out of it
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class Ingress:
    def __init__(self, handle: DeploymentHandle, deployment: str, encoder: PromptEncoder, block_size: int):
        self.handle, self.deployment, self.encoder = handle, deployment, encoder
        self.prefix_tokens = MAX_BLOCKS * block_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["path"] == "/metrics" and scope["method"] == "GET":
                await self._metrics(send)
            else:
                await self._forward(scope, receive, send)

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    def hint(self, path: str, body: bytes) -> RouteHint:
        try:
            ids = routed_prompt(path, json.loads(body), self.encoder) if body else None
        except Exception:   # a body the replica will refuse, with the reason: nothing to route by
            ids = None
        return RouteHint(prefix_ids=None if ids is None else tuple(ids[:self.prefix_tokens]))

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return   # the client left before it finished sending
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(parts)
        hint = await anyio.to_thread.run_sync(self.hint, scope["path"], body)
        request = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                   list(scope.get("headers", [])), body, scope.get("client"))
        response = self.handle.options(stream=True).http.remote(request, route=hint)
        started, streaming, gone = False, False, None
        async with anyio.create_task_group() as tasks:
            async def cancel_when_client_leaves() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                response.cancel()   # the replica's app sees its client leave and aborts the request
                tasks.cancel_scope.cancel()

            tasks.start_soon(cancel_when_client_leaves)
            try:
                async for message in response:
                    if message["type"] == "http.response.start":
                        started = True
                        streaming = dict(message.get("headers", [])).get(b"content-type", b"").startswith(
                            b"text/event-stream")
                    await send(message)
                    if message["type"] == "http.response.body" and not message.get("more_body", False):
                        break   # the response is complete (from here on uvicorn reports the client gone)
            except RequestCancelledError:   # the client left: nobody reads a reply
                pass
            except REPLICA_GONE as e:
                gone = e
            tasks.cancel_scope.cancel()
        if gone is not None:
            log.warning("a replica stopped while serving %s %s: %s", scope["method"], scope["path"], gone)
            await self._replica_gone(scope, receive, send, started, streaming)

    @staticmethod
    async def _replica_gone(scope: Scope, receive: Receive, send: Send, started: bool, streaming: bool) -> None:
        message = (f"the replica serving this request stopped before it finished; retry after {RETRY_AFTER_S} s "
                   f"(another replica takes it).")
        if not started:
            await error_response(503, message, code=GONE_CODE, headers={"Retry-After": str(RETRY_AFTER_S)},
                                 path=scope["path"])(scope, receive, send)
            return
        tail: Message = {"type": "http.response.body", "body": b"", "more_body": False}
        if streaming:   # the status went out already: the error is the stream's last event
            tail["body"] = stream_error(scope["path"], message).encode()
        await send(tail)

    async def _metrics(self, send: Send) -> None:
        router = router_of(self.deployment)
        replicas = router.replica_ids() if router is not None else []
        calls = [self.handle.metrics.remote(route=RouteHint(replica=r)) for r in replicas]
        results = await asyncio.gather(*(asyncio.wait_for(c, SCRAPE_TIMEOUT_S) for c in calls),
                                       return_exceptions=True)
        scrapes = [r for r in results if not isinstance(r, BaseException)]
        metrics = labelled([(replica, text) for replica, _, text in scrapes])
        metrics += ingress_metrics({replica: pid for replica, pid, _ in scrapes},
                                   router.counts() if router is not None else {})
        body = render(metrics)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def stream_error(path: str, message: str) -> str:
    """A stream's last event when its replica is gone, framed and shaped as the route's API does."""
    if path.startswith(ANTHROPIC_PREFIX):
        return typed_sse(anthropic_error_body(503, message))
    if path.startswith("/v1/responses"):
        return typed_sse({"type": "error", **error_body(503, message, code=GONE_CODE)})
    return f"data: {json.dumps(error_body(503, message, code=GONE_CODE))}\n\ndata: [DONE]\n\n"
