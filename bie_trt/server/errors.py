"""Every error the server sends has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
unknown routes (404), wrong methods (405), bodies that do not parse or validate (400), a bad API key
(401), a full queue (503) and faults inside the engine (500)."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import BieError
from .protocol import describe_error

log = logging.getLogger("bie_trt.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          503: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


class ApiError(Exception):
    """A request refused by a handler: rendered in the shape of the API the route belongs to."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _refused(_: Request, exc: ApiError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = describe_error(errors[0]) if errors else ("the request body is invalid.", None)
        return openai_error(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and POST /v1/completions."
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}."
        else:
            message = str(exc.detail)
        return openai_error(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(BieError)
    async def _bad(_: Request, exc: BieError) -> JSONResponse:
        return openai_error(400, str(exc))

    @app.exception_handler(Exception)
    async def _fault(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed inside the server")
        return openai_error(500, f"the server failed on this request: {type(exc).__name__}: {exc}")
