"""The API server's middlewares and hooks: errors in OpenAI's shape, the API key, the body
limit on `Expect: 100-continue`, and the headers every answer carries."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler

from frontend.errors import ApiError, error_response
from frontend.root_path import strip_root
from frontend.server_state import CTX, STATE
from frontend.serving import REQUEST_ID
from frontend.ui import routes as ui

logger = logging.getLogger("api_server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths answered without an API key.
# The built-in page's own files are open too: the page asks for the key (docs/ui.md).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", *ui.PAGE_PATHS})

# vLLM's key guards its /v1 routes only; these others are open there too. (Not /invocations,
# which vLLM leaves open by an oversight, vllm-project/vllm#58144, nor the admin routes.)
VLLM_OPEN_PATHS = frozenset(
    {"/ping", "/load", "/tokenize", "/detokenize", "/openapi.json", "/docs"}
)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message, e.param, e.headers)
    except RequestPayloadError as e:  # e.g. a gzip body that does not decompress
        response = error_response(
            400,
            f"the request body could not be read: {str(e.__cause__ or e).splitlines()[-1].strip()}",
        )
        response.force_close()  # the rest of the body cannot be read either
        return response
    except RecursionError:  # a shape no check foresaw; the client's doing, not the server's
        return error_response(400, "the request is nested too deeply to process")
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].max_body
        return error_response(413, f"the request body is larger than the limit of {limit} bytes")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {
            404: f"no route for {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
        }
        return error_response(e.status, message.get(e.status, e.reason))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {e}")


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 unless the request carries one of --api-key's keys (open paths excepted)."""
    state = request.app[STATE]
    key = state.api_key
    path = strip_root(request.path, state.http.root_path)
    if key is None or path in OPEN_PATHS or path in VLLM_OPEN_PATHS or request.method == "OPTIONS":
        return await handler(request)
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    # Several keys (vLLM's --api-key takes a list) travel one per line; each is compared.
    # aiohttp keeps a header's non-UTF-8 bytes as surrogates; they give them back to compare.
    given_key = token.strip().encode("utf-8", "surrogateescape")
    matches = [hmac.compare_digest(given_key, k.encode()) for k in key.split("\n")]
    if scheme.lower() != "bearer" or not any(matches):
        return error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)")
    return await handler(request)


async def _expect_within_limit(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: 413 before the body is sent when Content-Length is over the
    limit, else aiohttp's 100 Continue."""
    limit = request.app[STATE].max_body
    if request.content_length is not None and request.content_length > limit:
        response = error_response(
            413,
            f"the request body ({request.content_length} bytes) is "
            f"larger than the limit of {limit} bytes",
        )
        response.force_close()  # the body was never sent: nothing to read after it
        return response
    return await _default_expect_handler(request)


async def limit_expect_on_every_route(app: web.Application) -> None:
    """On start-up: every route answers `Expect: 100-continue` within the body limit."""
    for route in app.router.routes():  # aiohttp sets an expect handler per route only
        route._expect_handler = _expect_within_limit


async def mark_server(request: web.Request, response: web.StreamResponse) -> None:
    """Name the API server process that answered (X-Engine-Api-Server: its --index); add the
    CORS headers, and X-Request-Id with --enable-request-id-headers."""
    response.headers["X-Engine-Api-Server"] = str(request.app[CTX].api_server_index)
    state = request.app[STATE]
    state.cors.add_headers(request, response)
    if state.http.enable_request_id_headers:
        response.headers["X-Request-Id"] = (
            request.get(REQUEST_ID) or request.headers.get("X-Request-Id") or uuid.uuid4().hex
        )
