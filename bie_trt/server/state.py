"""What one engine's handlers share: the engine, the server's options, its metrics, the accounting
of the requests in flight and the Responses API's stored responses. The single-process app builds one around its engine; a replica deployment
builds one around its own, and both call the same handlers with it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import anyio

from ..executor.engine import BieEngine
from ..executor.streams import RequestStream
from .metrics import Metrics
from .response_store import DEFAULT_CAPACITY, ResponseStore
from .sealing import ReasoningSeal

# Threads that prepare requests (tokenising, the chat template, a grammar's compile, the start): however many
# clients arrive at once, the server holds at most this many for them; a request's events need none.
PREPARE_THREADS = 8
T = TypeVar("T")


@dataclass
class ServerOptions:
    # the name /v1/models lists and every reply's `model` carries (default: the engine's). A server serves one
    # engine (its replicas are that engine), so a request's `model` never picks one: any name is answered
    # by it, as llama-server answers, and the reply's `model` says which engine that was.
    served_model_name: str | None = None
    api_key: str | None = None             # None: no authentication
    max_waiting: int | None = None         # requests queued beyond the running batch; None: unbounded
    request_timeout: float | None = None   # seconds a request may take before it is aborted; None: no limit
    max_request_bytes: int | None = None   # larger bodies get 413 unread; None: from the context length
    kv_cache_dir: str | None = None        # where /v1/cache/save and /restore keep files; None: those routes are off
    response_store_size: int = DEFAULT_CAPACITY   # Responses API responses kept for previous_response_id (in memory)
    json_schema_mode: str = "closed"       # how JSON schema constraints are read unless a request says: or "lenient"
    reasoning_key: str | None = None       # seals Responses reasoning items; None: $BIE_TRT_REASONING_KEY or random


class ServerState:
    def __init__(self, engine: BieEngine, options: ServerOptions | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        self.model_id = self.options.served_model_name or engine.model_name
        # the engine's (EngineConfig.reasoning_parser): its thinking budgets find the block as the replies do
        self.reasoning_parser = engine.reasoning_parser()
        self.started = int(time.time())   # /v1/models' "created": when this server made the model available
        self.metrics = Metrics(engine.stats)
        # requests admitted and not yet finished; beyond the running batch plus --max-waiting, new ones get 503
        waiting = self.options.max_waiting
        self.capacity = math.inf if waiting is None else engine.max_num_seqs + waiting
        self.in_flight = 0
        self.live: set[RequestStream] = set()   # the engine requests of every HTTP request in flight
        self._preparers: anyio.CapacityLimiter | None = None
        self.responses = ResponseStore(self.options.response_store_size)
        self.seal = ReasoningSeal.from_environment(self.options.reasoning_key)

    def decode(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    async def prepare(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in one of the PREPARE_THREADS worker threads (work too slow for the event loop)."""
        if self._preparers is None:   # made inside the event loop, on first use
            self._preparers = anyio.CapacityLimiter(PREPARE_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._preparers)

    def close_live(self) -> None:
        """Ends every request still in flight (on shutdown, after the grace period)."""
        for events in list(self.live):
            events.close()
