"""--root-path: the API answers under a path prefix (a proxy that keeps it) and without it (a
proxy that strips it, as vLLM expects), with one set of routes."""

from __future__ import annotations

from aiohttp import web


def strip_root(path: str, root: str) -> str:
    """path without the root prefix (itself when it does not start with it)."""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def serve_under(app: web.Application, root: str) -> None:
    """Make app's router resolve /root/x as /x (every route, also those added later)."""
    resolve = app.router.resolve

    async def resolve_under_root(request: web.Request):
        path = strip_root(request.rel_url.path, root)
        if path != request.rel_url.path:
            request = request.clone(rel_url=request.rel_url.with_path(path))
        return await resolve(request)

    app.router.resolve = resolve_under_root  # type: ignore[method-assign]
