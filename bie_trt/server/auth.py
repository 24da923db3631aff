"""API keys: with a key set, every /v1 route (and /tokenize, /detokenize) needs `Authorization: Bearer <key>` (as vLLM does)
or `x-api-key: <key>` (as Anthropic's clients send it); /health and /metrics stay open for probes and scrapers. Compared in constant time, so response times
say nothing about how much of a guess was right."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def sent_keys(scope: Scope) -> list[str]:
    """The keys a request carries: a bearer token, an x-api-key header, or both."""
    keys = []
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            keys.append(token.strip() if scheme.lower() == "bearer" else "")
        elif name == b"x-api-key":
            keys.append(value.decode("latin-1").strip())
    return keys


class ApiKeyMiddleware:
    """Checks the key before anything reads the body, so a caller without it learns nothing else."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            # every key sent is compared (no early exit), and any one matching is enough
            matches = [hmac.compare_digest(key.encode(), self._key) for key in sent_keys(scope)]
            if not any(matches):
                response = error_response(401, "missing or incorrect API key; send the header "
                                               "'Authorization: Bearer <key>' (or 'x-api-key: <key>') with the "
                                               "server's --api-key.", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
