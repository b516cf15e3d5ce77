"""CORS for the API servers, answering as vLLM's (Starlette's CORSMiddleware) does: a preflight
(OPTIONS with Access-Control-Request-Method) is answered here, 200 or 400 "Disallowed CORS
origin, method, headers"; every other answer to a request with an Origin gets the
Access-Control-Allow-* headers."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# Request headers a browser may always send (the Fetch standard's CORS-safelisted ones).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsPolicy:
    """--allowed-origins, --allowed-methods, --allowed-headers and --allow-credentials."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    @property
    def allowed_methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else tuple(m.upper() for m in self.methods)

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def preflight(self, request: web.Request) -> web.Response | None:
        """The answer to a CORS preflight, or None when request is not one."""
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return None
        explicit = not self.any_origin or self.credentials
        headers = {
            "Access-Control-Allow-Methods": ", ".join(self.allowed_methods),
            "Access-Control-Max-Age": str(MAX_AGE_S),
        }
        headers["Vary" if explicit else "Access-Control-Allow-Origin"] = (
            "Origin" if explicit else "*"
        )
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if self.origin_allowed(origin):
            if explicit:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            failures.append("origin")
        if method.upper() not in self.allowed_methods:
            failures.append("method")
        asked = request.headers.get("Access-Control-Request-Headers")
        if "*" in self.headers:
            if asked is not None:
                headers["Access-Control-Allow-Headers"] = asked
        else:
            allowed = SAFELISTED_HEADERS | {h.lower() for h in self.headers}
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted(allowed))
            if asked is not None and any(
                h.strip().lower() not in allowed for h in asked.split(",") if h.strip()
            ):
                failures.append("headers")
        if failures:
            return web.Response(
                status=400, text=f"Disallowed CORS {', '.join(failures)}", headers=headers
            )
        return web.Response(status=200, text="OK", headers=headers)

    def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Give the answer to a cross-origin request the headers the browser checks."""
        origin = request.headers.get("Origin")
        if (
            origin is None
            or request.method == "OPTIONS"
            and "Access-Control-Allow-Methods" in response.headers
        ):
            return
        if self.any_origin and not ("Cookie" in request.headers or self.credentials):
            response.headers["Access-Control-Allow-Origin"] = "*"
        elif self.origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")
        else:
            return
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"


def cors_middleware(policy: CorsPolicy):
    """An aiohttp middleware answering preflights before routing, auth or anything else."""

    @web.middleware
    async def cors(request: web.Request, handler) -> web.StreamResponse:
        answer = policy.preflight(request)
        return answer if answer is not None else await handler(request)

    return cors
