"""What one API server's handlers and middlewares read: the ServingContext (the engine as the
handlers see it) and the ServerState (the server's flags and its live bookkeeping), each under
one typed aiohttp AppKey."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from config.observability import ObservabilityConfig
from frontend.cors import CorsPolicy
from frontend.http_options import HttpOptions
from frontend.serving import ServingContext


@dataclass
class ServerState:
    """One API server's flags, fixed at start, and what changes while it serves (draining,
    the ids of the requests in flight)."""

    api_key: str | None  # --api-key's keys, one per line; None: every route is open
    max_body: int  # --max-request-body, in bytes
    engine_alive: Callable[[], bool]  # false once the engine core has exited
    unavailable: Callable[[], str | None]  # why requests must wait (starting, a lost process)
    http: HttpOptions
    cors: CorsPolicy
    log_requests: ObservabilityConfig | None  # --enable-log-requests: log each request
    defaults: dict[str, Any]  # the generation config's sampling defaults
    openapi: dict[str, Any]  # /openapi.json's document
    draining: bool = False  # set on SIGTERM: new requests get 503
    live_ids: set[str] = field(default_factory=set)  # '<prefix>-<id>' of requests in flight

    def why_unavailable(self) -> str | None:
        """Why this server cannot take a request now, or None."""
        if self.draining:
            return "the server is shutting down"
        if not self.engine_alive():
            return "the engine core is not running"
        return self.unavailable()


CTX = web.AppKey("ctx", ServingContext)
STATE = web.AppKey("state", ServerState)
