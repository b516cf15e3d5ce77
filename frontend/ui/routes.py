"""The built-in page (GET / and /ui) and the JSON it polls (/ui/api/...): docs/ui.md."""

from __future__ import annotations

import os
import time
from importlib import resources
from typing import Any

from aiohttp import web

from frontend.errors import ApiError
from frontend.serving import ServingContext, json_response
from frontend.ui.processes import process_tree
from frontend.ui.stats import snapshot
from frontend.ui.timeline import RequestTimeline, TimelineClient
from metrics.exposition import ENV_VAR

# The page's own files, answered without an API key (the page then asks for the key).
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
PAGE_PATHS = frozenset({"/", "/ui", *(f"/ui/{name}" for name in _FILES)})

TIMELINE = web.AppKey("ui_timeline", RequestTimeline)
INFO = web.AppKey("ui_info", dict)
# The process tree is read from /proc at most this often, however many pages poll.
_PROCESS_TTL_S = 1.0


def _static(name: str) -> bytes:
    return resources.files("frontend.ui").joinpath("static", name).read_bytes()


def register(app: web.Application, ctx: ServingContext, config: Any) -> None:
    """Serve the page and its data endpoints on app, and record request timelines through
    ctx.client (config: the resolved EngineConfig, for the configuration panel)."""
    directory = os.environ.get(ENV_VAR)
    timeline = RequestTimeline(os.path.join(directory, "ui") if directory else None)
    ctx.client = TimelineClient(ctx.client, timeline, ctx.api_server_index)
    ready = ctx.client.ready[0]
    app[TIMELINE] = timeline
    app[INFO] = {"config": {
        "model": ctx.model_name, "model_path": ctx.model_root,
        "max_model_len": ctx.max_model_len, "block_size": ready.block_size,
        "num_kv_blocks": ready.num_blocks, "dtype": config.torch_dtype_name,
        "device": config.device_type, "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "data_parallel_size": config.parallel.data_parallel_size,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "tokenizer_workers": len(ctx.client.ready)},
        "processes": [], "processes_at": 0.0}
    files = {name: _static(name) for name in _FILES}

    def page(name: str):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=files[name], content_type=_FILES[name],
                                headers={"Cache-Control": "no-cache"})
        return handler

    for path in ("/", "/ui"):
        app.router.add_get(path, page("index.html"))
    for name in _FILES:
        app.router.add_get(f"/ui/{name}", page(name))
    app.router.add_get("/ui/api/stats", stats)
    app.router.add_get("/ui/api/requests", requests)
    app.router.add_get("/ui/api/requests/{request_id}", request_text)


async def stats(request: web.Request) -> web.Response:
    """The live view: /metrics's numbers now, the configuration and the process tree."""
    info = request.app[INFO]
    now = time.time()
    if now - info["processes_at"] > _PROCESS_TTL_S:
        info["processes"], info["processes_at"] = process_tree(), now
    return json_response({"time": now, "metrics": snapshot(), "config": info["config"],
                          "processes": info["processes"]})


async def requests(request: web.Request) -> web.Response:
    """The last finished requests of every API server (no texts)."""
    return json_response({"time": time.time(), "requests": request.app[TIMELINE].recent()})


async def request_text(request: web.Request) -> web.Response:
    """One recent request's prompt and outputs."""
    found = request.app[TIMELINE].texts(request.match_info["request_id"])
    if found is None:
        raise ApiError(404, "no such request among the recent ones")
    return json_response(found)
