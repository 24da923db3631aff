"""Every error the server sends has the shape of the API its route belongs to: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or Anthropic's `{"type": "error", "error": {"type",
"message"}}` under /v1/messages. That covers unknown routes (404), wrong methods (405), bodies that do
not parse or validate (400), a bad API key (401), a full queue (503) and faults inside the engine (500)."""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import BieError
from .protocols import anthropic as anthropic_protocol, openai_responses as responses_protocol
from .protocols.openai import SHAPES, describe_error

log = logging.getLogger("bie_trt.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


# Anthropic's error types by status (its API reference); validation problems are invalid_request_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's shape; it has no param or code, so the message names the field."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def body_for_path(path: str) -> Callable[..., dict]:
    """The error shape of the API a route belongs to."""
    return anthropic_error_body if path.startswith(ANTHROPIC_PREFIX) else error_body


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """An error response in the shape of `path`'s API (OpenAI's unless it is an Anthropic route)."""
    return JSONResponse(body_for_path(path)(status, message, param, code), status, headers=headers)


class ApiError(Exception):
    """A request refused by a handler: rendered in the shape of the API the route belongs to."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


# Each body route's union fields and the tags of its tagged lists, for its validation messages.
_VALIDATION = {path: (api.SHAPES, frozenset(tags)) for path, api, tags in (
    ("/v1/messages", anthropic_protocol, anthropic_protocol.BLOCK_TYPES),
    ("/v1/messages/count_tokens", anthropic_protocol, anthropic_protocol.BLOCK_TYPES),
    ("/v1/responses", responses_protocol, responses_protocol.ITEM_TYPES))}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _refused(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        path = request.url.path
        shapes, tags = _VALIDATION.get(path, (SHAPES, frozenset()))
        message, param = describe_error(errors[0], shapes, tags) if errors else ("the request body is invalid.", None)
        return error_response(400, message, param, path=path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and POST /v1/completions."
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}."
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers, path=request.url.path)

    @app.exception_handler(BieError)
    async def _bad(request: Request, exc: BieError) -> JSONResponse:
        return error_response(400, str(exc), path=request.url.path)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed inside the server")
        return error_response(500, f"the server failed on this request: {type(exc).__name__}: {exc}",
                              path=request.url.path)
