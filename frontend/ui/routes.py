"""The built-in page (GET / and /ui) and the JSON it polls (/ui/api/...): docs/ui.md."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web

from config.engine import EngineConfig
from frontend.errors import ApiError
from frontend.serving import ServingContext, json_response
from frontend.ui.processes import process_tree
from frontend.ui.stats import snapshot
from frontend.ui.timeline import RequestTimeline, TimelineClient
from metrics.exposition import ENV_VAR

# The page's own files, answered without an API key (the page then asks for the key).
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
PAGE_PATHS = frozenset({"/", "/ui", *(f"/ui/{name}" for name in _FILES)})

# The live view is computed at most this often, however many pages poll.
_ANSWER_TTL_S = 1.0


class SharedAnswer:
    """A value computed at most once per ttl_s and shared by every caller in the meantime, so
    N open pages cost this API server what one does."""

    def __init__(self, compute: Callable[[], Any], ttl_s: float = _ANSWER_TTL_S) -> None:
        self._compute = compute
        self._ttl_s = ttl_s
        self._value: Any = None
        self._at = -math.inf

    def get(self) -> Any:
        now = time.monotonic()
        if now - self._at >= self._ttl_s:
            self._value, self._at = self._compute(), now
        return self._value


STATS = web.AppKey("ui_stats", SharedAnswer)
TIMELINE = web.AppKey("ui_timeline", RequestTimeline)
_ENCODER = msgspec.json.Encoder()


def _static(name: str) -> bytes:
    return resources.files("frontend.ui").joinpath("static", name).read_bytes()


def register(app: web.Application, ctx: ServingContext, config: EngineConfig) -> None:
    """Serve the page and its data endpoints on app, and record request timelines through
    ctx.client (config: the resolved EngineConfig, for the configuration panel)."""
    directory = os.environ.get(ENV_VAR)
    timeline = RequestTimeline(os.path.join(directory, "ui") if directory else None)
    ctx.client = TimelineClient(ctx.client, timeline, ctx.api_server_index)
    ready = ctx.client.ready[0]
    page_config = {
        "model": ctx.model_name,
        "model_path": ctx.model_root,
        "max_model_len": ctx.max_model_len,
        "block_size": ready.block_size,
        "num_kv_blocks": ready.num_blocks,
        "dtype": config.torch_dtype_name,
        "device": config.device_type,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "data_parallel_size": config.parallel.data_parallel_size,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "tokenizer_workers": len(ctx.client.ready),
    }
    app[STATS] = SharedAnswer(
        lambda: _ENCODER.encode(
            {
                "time": time.time(),
                "metrics": snapshot(),
                "config": page_config,
                "processes": process_tree(),
            }
        )
    )
    app[TIMELINE] = timeline
    files = {name: _static(name) for name in _FILES}

    def page(name: str):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(
                body=files[name], content_type=_FILES[name], headers={"Cache-Control": "no-cache"}
            )

        return handler

    for path in ("/", "/ui"):
        app.router.add_get(path, page("index.html"))
    for name in _FILES:
        app.router.add_get(f"/ui/{name}", page(name))
    app.router.add_get("/ui/api/stats", stats)
    app.router.add_get("/ui/api/requests", requests)
    app.router.add_get("/ui/api/requests/{request_id}", request_text)


async def stats(request: web.Request) -> web.Response:
    """The live view: /metrics's numbers, the configuration and the process tree, as of at most
    a second ago (one encoded answer shared by every poller)."""
    return web.Response(body=request.app[STATS].get(), content_type="application/json")


async def requests(request: web.Request) -> web.Response:
    """The last finished requests of every API server (no texts); with ?after=T only those
    that finished after T (the newest finish time the caller holds)."""
    after = request.query.get("after")
    records = request.app[TIMELINE].recent()
    if after is not None:
        try:
            since = float(after)
        except ValueError:
            raise ApiError(400, f"after must be a finish time in seconds, got {after!r}") from None
        records = [r for r in records if r["finish"] > since]
    return json_response({"time": time.time(), "requests": records})


async def request_text(request: web.Request) -> web.Response:
    """One recent request's prompt and outputs."""
    found = request.app[TIMELINE].texts(request.match_info["request_id"])
    if found is None:
        raise ApiError(404, "no such request among the recent ones")
    return json_response(found)
