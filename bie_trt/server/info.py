"""The handlers of GET /health, /metrics (Prometheus) and /v1/models."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from .metrics import CONTENT_TYPE
from .state import ServerState


async def health(state: ServerState) -> dict:
    return {"status": "ok"}


async def metrics(state: ServerState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def models(state: ServerState) -> dict:
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.started,
                                        "owned_by": "bie-trt", "max_model_len": state.engine.max_model_len}]}


def register(app: FastAPI, state: ServerState) -> None:
    """GET /health, /metrics and /v1/models on `app`."""

    @app.get("/health")
    async def health_route() -> dict:
        return await health(state)

    @app.get("/metrics")
    async def prometheus_metrics():
        return await metrics(state)

    @app.get("/v1/models")
    async def models_route() -> dict:
        return await models(state)
