"""The routers Ray Serve made in this process, by deployment name. Ray ships a router class to the
handle's process pickled by value, module globals and all, so the router module's own globals are a
copy; this module is imported by name, so the ingress and the router see the same dict."""
from __future__ import annotations

from typing import Any

ROUTERS: dict[str, Any] = {}
