"""Start (or join) a Ray cluster, deploy N engine replicas on Ray Serve behind the prefix-affinity
router, and hand back the ingress app that the `bie-trt serve` process serves; stop it all again.

Without an address a local Ray instance is started inside this process, kept small (no dashboard, a
small object store: what crosses between processes is request bodies and response chunks), and shut
down with the server. With an address the replicas join that cluster, and stopping removes only them.
Serve's own HTTP proxy is off: the endpoint is this process's server, so its bind, limits, API key and
graceful stop are the single-process server's.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from starlette.types import ASGIApp

from ..config import EngineConfig
from ..engine_format import read_manifest
from ..errors import BieError
from ..resolve import resolve
from ..server.auth import ApiKeyMiddleware
from ..server.limits import BodySizeLimit, default_max_request_bytes
from ..server.state import ServerOptions

APP = "bie-trt"
DEPLOYMENT = "BieReplica"
OBJECT_STORE_BYTES = 128 * 2**20
HEALTH_CHECK_PERIOD_S = 2.0     # how soon Serve notices a replica that stopped answering and replaces it
DEFAULT_OVERLOAD = 4            # requests beyond the least-loaded replica before affinity yields


def require_ray(option: str) -> None:
    """Ray Serve is an extra: without it, one line naming what to install, before anything starts."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise BieError(f"{option} runs on Ray Serve, which is not installed here; install it with "
                       f"`pip install 'bie-trt[ray]'`, or serve a single engine without {option}.") from None


@dataclass
class ScaleOutOptions:
    replicas: int
    ray_address: str | None = None     # None: a local Ray instance, started and stopped with the server
    router: str = "prefix-affinity"    # or "power-of-two" (Ray Serve's default policy)
    overload: int = DEFAULT_OVERLOAD
    shutdown_timeout: float = 30.0


class ScaleOut:
    def __init__(self, config: EngineConfig, server: ServerOptions, options: ScaleOutOptions):
        self.config, self.server, self.options = config, server, options
        self.started_ray = False
        self.connected = False   # to a Ray instance: what `stop` has to undo

    def start(self) -> ASGIApp:
        """Every replica loaded and ready; the ingress app (with the server's API key and body limit)."""
        import ray
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from ..executor.prompt_encoder import PromptEncoder
        from .affinity import RouteHint
        from .ingress import Ingress
        from .replica import BieReplica
        from .router import ROUTERS

        opts, config = self.options, self.config
        settings = resolve(config, read_manifest(config.engine_dir))   # refused as one engine refuses it
        on_gpu = config.device.startswith("cuda")
        if opts.ray_address is None:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, namespace=APP, configure_logging=False)
            self.started_ray = self.connected = True
        else:
            try:
                ray.init(address=opts.ray_address, namespace=APP, configure_logging=False)
                self.connected = True
            except ConnectionError as e:
                raise BieError(f"--ray-address {opts.ray_address}: no Ray cluster answers there ({e}); start one "
                               f"with `ray start --head` and pass the address it prints.") from None
        serve.start(http_options={"location": "NoServer"}, logging_config={"log_level": "WARNING"})
        block_size = settings.kv.block_size
        router = RequestRouterConfig(
            request_router_class=ROUTERS[opts.router],
            request_router_kwargs={"block_size": block_size, "overload": opts.overload}
            if opts.router == "prefix-affinity" else {})
        # Requests queue in the engine (bounded by --max-waiting there), not in Ray's router.
        max_ongoing = 100_000 if self.server.max_waiting is None else settings.max_num_seqs + self.server.max_waiting
        # On the CPU, replicas on one machine split its cores; each GPU replica holds one GPU.
        threads = None if on_gpu or opts.ray_address else max(1, (os.cpu_count() or 1) // opts.replicas)
        replica_options = dataclasses.replace(self.server, api_key=None)   # the ingress checks the key
        deployment = serve.deployment(BieReplica, name=DEPLOYMENT).options(
            num_replicas=opts.replicas, max_ongoing_requests=max_ongoing,
            ray_actor_options={"num_cpus": 0, "num_gpus": 1 if on_gpu else 0},
            request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
            graceful_shutdown_timeout_s=opts.shutdown_timeout, logging_config={"log_level": "WARNING"})
        handle = serve.run(deployment.bind(config, replica_options, threads), name=APP, route_prefix=None)
        handle.metrics.remote(route=RouteHint()).result()   # Serve makes the router at the first request
        app: ASGIApp = Ingress(handle, DEPLOYMENT, PromptEncoder.load(config.engine_dir, config.chat_template,
                                                                    config.chat_template_kwargs),
                               block_size)
        if self.server.api_key:
            app = ApiKeyMiddleware(app, self.server.api_key)
        limit = self.server.max_request_bytes or default_max_request_bytes(settings.max_model_len)
        return BodySizeLimit(app, limit)

    def stop(self) -> None:
        """The replicas stopped (each finishing what it still runs), and the Ray instance if this started it."""
        if not self.connected:   # nothing started (Ray may not even be installed)
            return
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP)
            ray.shutdown()   # only this driver's connection: the cluster is someone else's

