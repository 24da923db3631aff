"""Bearer API keys: with a key set, every /v1 route (and /tokenize, /detokenize) needs `Authorization: Bearer <key>` (as vLLM does;
/health and /metrics stay open for probes and scrapers). Compared in constant time, so response times
say nothing about how much of a guess was right."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import openai_error

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def bearer_token(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class ApiKeyMiddleware:
    """Checks the key before anything reads the body, so a caller without it learns nothing else."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            if not hmac.compare_digest(bearer_token(scope).encode(), self._key):
                response = openai_error(401, "missing or incorrect API key; send the header "
                                             "'Authorization: Bearer <key>' with the server's --api-key.",
                                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
