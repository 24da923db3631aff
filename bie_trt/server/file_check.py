"""The engine's files hashed again in the background once the server is up: loading trusted the
digests remembered per file (by size and mtime), and bit rot keeps both. On a mismatch the server
logs it and stops serving: /health and every route but /metrics answer 503 with the reason."""
from __future__ import annotations

import threading

from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine_format import read_manifest
from ..integrity import recheck_engine_files
from .errors import log, error_response


class BackgroundFileCheck:
    def __init__(self, engine_dir: str):
        self.engine_dir = engine_dir
        self.problem: str | None = None   # set once, by the checking thread

    def start(self) -> None:
        threading.Thread(target=self._run, name="bie-file-check", daemon=True).start()

    def _run(self) -> None:
        try:
            problems = recheck_engine_files(self.engine_dir, read_manifest(self.engine_dir))
        except Exception as e:   # an unreadable manifest or file is damage too
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            self.problem = (f"engine {self.engine_dir} failed its background sha256 check ({'; '.join(problems)}); "
                            f"stopped serving. Restore or rebuild the engine (`bie-trt verify` says what is wrong), "
                            f"then restart the server.")
            log.error(self.problem)
        else:
            log.info("engine %s: every file matches its sha256 again (background check)", self.engine_dir)


class DamagedEngineMiddleware:
    """503 for every request but /metrics once the background check has failed."""

    def __init__(self, app: ASGIApp, check: BackgroundFileCheck):
        self.app, self.check = app, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.check.problem is not None and scope["path"] != "/metrics":
            await error_response(503, self.check.problem, code="engine_damaged", path=scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)
