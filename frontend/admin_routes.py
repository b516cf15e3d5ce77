"""vLLM's routes beside the OpenAI API: GET /load (requests in flight on this API server),
POST /reset_prefix_cache and GET /server_info."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from engine_core.client import AsyncEngineCoreClient
from frontend.errors import ApiError
from frontend.serving import json_response

# The routes whose requests /load counts while they run (vLLM counts its generation routes).
LOADED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


class LoadResponse(msgspec.Struct, kw_only=True):
    server_load: int


class ServerInfoResponse(msgspec.Struct, kw_only=True):
    version: str
    served_model_names: list[str]
    # The resolved configuration, as EngineConfig's fields (model path, dtype, KV cache, ...).
    engine_config: dict[str, Any]


@dataclass
class AdminState:
    """What the routes read: the in-flight count, the engine cores' addresses, the config."""

    engine_addresses: list[str] = field(default_factory=list)
    server_info: ServerInfoResponse | None = None
    in_flight: int = 0


ADMIN = web.AppKey("admin", AdminState)


@web.middleware
async def count_load(request: web.Request, handler) -> web.StreamResponse:
    """Count the requests of LOADED_PATHS until their answer is complete (streams included)."""
    state = request.app[ADMIN]
    if (
        request.match_info.route.resource is None
        or request.match_info.route.resource.canonical not in LOADED_PATHS
    ):
        return await handler(request)
    state.in_flight += 1
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1


async def load(request: web.Request) -> web.Response:
    return json_response(LoadResponse(server_load=request.app[ADMIN].in_flight))


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Drop every engine core's prefix cache (vLLM's route); 409 while requests hold blocks."""
    addresses = request.app[ADMIN].engine_addresses
    if not addresses:
        raise ApiError(503, "this API server was started without the engine cores' addresses")
    results = await asyncio.gather(*(_call_utility(a, "reset_prefix_cache") for a in addresses))
    refused = [rank for rank, done in enumerate(results) if not done]
    if refused:
        ranks = "" if len(addresses) == 1 else f" (engine cores {refused})"
        raise ApiError(
            409,
            f"the prefix cache was not reset{ranks}: running requests hold "
            "KV blocks; retry when they have finished",
        )
    return web.Response(status=200)


async def _call_utility(address: str, method: str) -> Any:
    # A connection per call: an engine core in a data-parallel group sends its load to every
    # client after each step, which a connection kept open would have to read.
    client = await AsyncEngineCoreClient.create(
        address, client_name="api-admin", startup_timeout=10.0
    )
    try:
        return await client.call_utility(method)
    finally:
        client.shutdown()


async def server_info(request: web.Request) -> web.Response:
    info = request.app[ADMIN].server_info
    if info is None:
        raise ApiError(503, "no configuration was given to this API server")
    return json_response(info)


def register(app: web.Application, state: AdminState) -> None:
    """Add the routes and the state they read to app."""
    app[ADMIN] = state
    app.router.add_get("/load", load)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/server_info", server_info)
