"""The OpenAI-compatible HTTP API server: an aiohttp app on uvloop.

`engine serve` starts --api-server-count of them (`engine-api-<i>`) after the tokenizer
processes; they accept from one listening socket the launcher made (so the port is ours
alone), and each connects a TokenizerClient to every tokenizer process. Endpoints:
docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

import msgspec
from aiohttp import web

from config.engine import decode_config
from config.generation_config import log_defaults
from config.observability import ObservabilityConfig
from engine_core.log_options import apply_log_options
from frontend import admin_routes, middlewares
from frontend.admin_routes import AdminState, ServerInfoResponse, count_load
from frontend.chat_args import ChatOptions, add_chat_args
from frontend.cors import CorsPolicy, cors_middleware
from frontend.errors import ApiError, bad_request, error_response, from_decode_error
from frontend.harmony_prompt import render_prompt
from frontend.http_options import HttpOptions, add_http_args
from frontend.json_limits import check_depth, check_int64
from frontend.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from frontend.openapi import DOCS_HTML, openapi_schema
from frontend.reasoning.registry import reasoning_parser
from frontend.root_path import serve_under
from frontend.server_state import CTX, STATE, ServerState
from frontend.serving import REQUEST_ID, ServingContext, json_response
from frontend.serving_chat import chat_messages, create_chat_completion, template_kwargs
from frontend.serving_completions import create_completion
from frontend.serving_harmony import harmony_chat_for
from frontend.ui import routes as ui
from ipc.process import EXIT_REQUESTS_CUT, StopOrder, pid_alive, start_child_process
from metrics.exposition import render_metrics

logger = logging.getLogger("api_server")

DEFAULT_MAX_REQUEST_BODY = 16 * 1024 * 1024
# A 503's Retry-After: by then a load balancer has another server, or this one is back.
RETRY_AFTER_S = 5
# How long handlers get to send their last event, and aiohttp to close connections, once the
# requests in flight have finished or failed.
_CLOSE_S = 2.0


def process_name(index: int) -> str:
    """The API server's name in /proc/<pid>/comm."""
    return f"engine-api-{index}"


def _version() -> str:
    try:
        return metadata.version("engine")
    except metadata.PackageNotFoundError:
        return "0.1.0"


# ---- handlers ----


async def _decode(request: web.Request, struct: type) -> Any:
    body = await request.read()
    check_depth(body)
    try:
        req = msgspec.json.decode(body, type=struct)
    except msgspec.MsgspecError as e:
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:  # msgspec's error for a string that is not UTF-8
        raise bad_request(f"the request body is not valid UTF-8: {e}") from None
    check_int64(body, req)
    return req


def _check_available(request: web.Request) -> None:
    reason = request.app[STATE].why_unavailable()
    if reason is not None:
        raise ApiError(503, reason, headers={"Retry-After": str(RETRY_AFTER_S)})


async def health(request: web.Request) -> web.Response:
    """200 once every process of the server is ready and while all of them run; else 503."""
    reason = request.app[STATE].why_unavailable()
    if reason is not None:
        return error_response(503, reason, headers={"Retry-After": str(RETRY_AFTER_S)})
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(version=_version()))


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    names = ctx.served_model_names or (ctx.model_name,)
    return json_response(
        ModelList(
            data=[
                ModelCard(id=name, root=ctx.model_root, max_model_len=ctx.max_model_len)
                for name in names
            ]
        )
    )


def apply_generation_defaults(req: Any, defaults: dict[str, Any]) -> None:
    """The generation config's defaults, as vLLM applies them: a sampling field the request
    left unset takes its default; max_tokens caps the output length asked for (an unset one
    is capped by the tokenizer process, which knows the prompt's length)."""
    for name, value in defaults.items():
        if name != "max_tokens" and getattr(req, name) is None:
            setattr(req, name, value)
    cap = defaults.get("max_tokens")
    if cap is None:
        return
    field = (
        "max_completion_tokens"
        if getattr(req, "max_completion_tokens", None) is not None
        else "max_tokens"
    )
    if getattr(req, field) is not None:
        setattr(req, field, min(getattr(req, field), cap))


@contextlib.asynccontextmanager
async def prepared(request: web.Request, req: Any, prefix: str) -> AsyncIterator[None]:
    """Around one generation request: choose its id as vLLM does (a client's X-Request-Id,
    else the body's request_id, else a random one; serving.request_id reads it; 400 while
    another request of this API server has it), fill the generation config's defaults, and
    log it when --enable-log-requests is set."""
    state = request.app[STATE]
    given = request.headers.get("X-Request-Id") or getattr(req, "request_id", None)
    request[REQUEST_ID] = base = given or uuid.uuid4().hex
    live = f"{prefix}-{base}"
    if live in state.live_ids:
        raise bad_request(f"request id {base!r} is already in use by a request in flight")
    apply_generation_defaults(req, state.defaults)
    log = state.log_requests
    if log is not None:
        body = (await request.read()).decode(errors="replace")
        logger.info(
            "Received request %s: %s %s",
            live,
            request.path,
            body if log.max_log_len is None else body[: log.max_log_len],
        )
    state.live_ids.add(live)
    try:
        yield
    finally:
        state.live_ids.discard(live)


async def completions(request: web.Request) -> web.StreamResponse:
    req = await _decode(request, CompletionRequest)
    _check_available(request)
    async with prepared(request, req, "cmpl"):
        return await create_completion(request.app[CTX], req, request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await _decode(request, ChatCompletionRequest)
    _check_available(request)
    async with prepared(request, req, "chatcmpl"):
        return await create_chat_completion(request.app[CTX], req, request)


async def tokenize(request: web.Request) -> web.Response:
    req = await _decode(request, TokenizeRequest)
    ctx = request.app[CTX]
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    messages = chat_messages(req.messages) if req.messages is not None else None
    try:  # in a thread: a long prompt must not stall the other requests of this event loop
        ids, strs = await asyncio.to_thread(_tokenize, ctx, req, messages)
    except ValueError as e:
        raise bad_request(str(e)) from None
    return json_response(
        TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )
    )


def _tokenize(
    ctx: ServingContext, req: TokenizeRequest, messages: list[dict[str, Any]] | None
) -> tuple[list[int], list[str] | None]:
    """/tokenize's token ids and (with return_token_strs) their strings."""
    from tokenizer_proc.tokenizer import apply_chat_template

    tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    if messages is None:
        ids = ctx.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    elif ctx.harmony is not None:  # gpt-oss: as chat completions renders it
        if req.continue_final_message or req.chat_template or req.chat_template_kwargs:
            raise ValueError(
                "continue_final_message, chat_template and chat_template_kwargs are not "
                "supported for gpt-oss (its prompt is rendered by openai-harmony)"
            )
        ids = render_prompt(ctx.harmony.encoding, messages, tools, None, req.add_generation_prompt)
    else:
        ids = apply_chat_template(
            ctx.tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template or ctx.chat_template,
            tools=tools,
            chat_template_kwargs=template_kwargs(req.chat_template_kwargs),
        )
    return ids, ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None


async def detokenize(request: web.Request) -> web.Response:
    req = await _decode(request, DetokenizeRequest)
    ctx = request.app[CTX]
    ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"token ids out of range [0, {ctx.vocab_size}): {bad[:10]}", "tokens")
    text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens)  # off the event loop
    return json_response(DetokenizeResponse(prompt=text))


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's route: a chat completion when the body has messages, a completion when it
    has prompt."""
    raw = await request.read()
    check_depth(raw)
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if isinstance(body, dict) and "messages" in body:
        return await chat_completions(request)
    if isinstance(body, dict) and "prompt" in body:
        return await completions(request)
    raise bad_request(
        "/invocations takes a chat completion request (with messages) or a "
        "completion request (with prompt)"
    )


async def openapi(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].openapi)


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_HTML, content_type="text/html")


def build_app(
    ctx: ServingContext,
    *,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_REQUEST_BODY,
    engine_alive=lambda: True,
    unavailable=lambda: None,
    http: HttpOptions = HttpOptions(),
    admin: AdminState | None = None,
    log_requests: ObservabilityConfig | None = None,
    generation_defaults: dict[str, Any] | None = None,
) -> web.Application:
    """The aiohttp application of one API server. engine_alive() false, or unavailable() giving
    a reason, make /health and new requests 503. log_requests: log each generation request
    (--enable-log-requests), cut at its max_log_len. generation_defaults: sampling defaults
    for requests that leave a field unset (engine_core.generation_config)."""
    cors = CorsPolicy(
        http.allowed_origins, http.allowed_methods, http.allowed_headers, http.allow_credentials
    )
    app = web.Application(
        middlewares=[cors_middleware(cors), middlewares.errors, middlewares.auth, count_load],
        client_max_size=max_body,
    )
    serve_under(app, http.root_path)
    app[CTX] = ctx
    app[STATE] = ServerState(
        api_key=api_key,
        max_body=max_body,
        engine_alive=engine_alive,
        unavailable=unavailable,
        http=http,
        cors=cors,
        log_requests=log_requests,
        defaults=generation_defaults or {},
        openapi=openapi_schema(http.root_path, _version()),
    )
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # SageMaker's health check
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/invocations", invocations)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if not http.disable_fastapi_docs:
        app.router.add_get("/openapi.json", openapi)
        app.router.add_get("/docs", docs)
    app.router.add_get("/metrics", metrics)  # open without an API key (middlewares.OPEN_PATHS)
    admin_routes.register(app, admin or AdminState())
    app.on_response_prepare.append(middlewares.mark_server)
    app.on_startup.append(middlewares.limit_expect_on_every_route)
    return app


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition: one view over every engine process (multiprocess mode)."""
    body, content_type = render_metrics()
    # aiohttp wants the charset apart from the media type.
    media_type, _, params = content_type.partition(";")
    charset = params.split("charset=")[-1].strip() if "charset=" in params else None
    return web.Response(body=body, content_type=media_type.strip(), charset=charset)


# ---- the process ----


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, ours alone: no SO_REUSEPORT, so a port another
    server listens on fails here with EADDRINUSE (SO_REUSEADDR only skips TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


async def run_api_server(args: argparse.Namespace) -> int:
    from tokenizer_proc.client import TokenizerClient
    from tokenizer_proc.tokenizer import load_tokenizer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    config = decode_config(args.config)
    apply_log_options(config.observability)
    defaults = config.sampling_defaults
    if args.index == 0:
        log_defaults(defaults)
    http = HttpOptions.from_args(args)
    tokenizer = load_tokenizer(config.tokenizer_path)
    # Started beside the engine core, we wait for the tokenizer processes as long as the model
    # loads (the launcher enforces --startup-timeout); a stop signal meanwhile ends us cleanly.
    connect = asyncio.create_task(
        TokenizerClient.create(
            args.tokenizer_address,
            client_name=process_name(args.index),
            pids=args.tokenizer_pid or None,
            timeout=None,
        )
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([connect, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not connect.done():
        connect.cancel()
        return 0
    stopping.cancel()
    client = connect.result()
    ready = client.ready[0]
    chat = ChatOptions.from_args(args)
    # gpt-oss: chat prompts and answers go through openai-harmony (loaded here, before serving).
    harmony = harmony_chat_for(config.arch.model_type, tokenizer) if config.arch else None
    ctx = ServingContext(
        ready.model_name,
        ready.max_model_len,
        ready.vocab_size,
        client,
        tokenizer,
        args.index,
        str(config.model_path),
        chat.response_role,
        chat.chat_template,
        chat.auto_tool_parser,
        served_model_names=tuple(config.model.served_model_names),
        enable_prompt_tokens_details=chat.enable_prompt_tokens_details,
        harmony=harmony,
        reasoning_parser=reasoning_parser(chat.reasoning_parser, tokenizer),
    )
    info = ServerInfoResponse(
        version=_version(),
        served_model_names=config.model.served_model_names,
        engine_config=dataclasses.asdict(config),
    )
    obs = config.observability
    app = build_app(
        ctx,
        api_key=args.api_key or os.environ.get("ENGINE_API_KEY") or os.environ.get("VLLM_API_KEY"),
        max_body=args.max_request_body,
        engine_alive=lambda: args.engine_pid is None or pid_alive(args.engine_pid),
        unavailable=lambda: starting(args.serving_file) or client.unavailable(),
        http=http,
        admin=AdminState(args.engine_address or [], info),
        log_requests=obs if obs.enable_log_requests else None,
        generation_defaults=defaults,
    )
    if not args.disable_ui:
        ui.register(app, ctx, config)
    # Requests have finished or failed (drain) before cleanup waits this long for handlers.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_CLOSE_S
    )
    await runner.setup()
    if http.uds:
        site: web.BaseSite = web.UnixSite(runner, http.uds, ssl_context=http.ssl_context())
    else:
        # The launcher's listening socket, shared by every API server (else one of our own).
        sock = (
            socket.socket(fileno=args.listen_fd)
            if args.listen_fd is not None
            else listening_socket(args.host, args.port)
        )
        sock.setblocking(False)
        site = web.SockSite(runner, sock, ssl_context=http.ssl_context())
    await site.start()
    logger.info("API server %d serving on %s", args.index, http.url(args.host, args.port))
    if args.ready_file:
        with open(args.ready_file, "w") as f:  # noqa: ASYNC230 (a few bytes, a local file)
            f.write(str(os.getpid()))
    await stop.wait()
    cut = await drain(app, StopOrder.read(args.stop_file, args.shutdown_timeout))
    await runner.cleanup()  # stops accepting, closes idle connections
    client.shutdown()
    return EXIT_REQUESTS_CUT if cut else 0


def starting(serving_file: str | None) -> str | None:
    """Until the launcher has written serving_file (every process of the server is ready),
    why requests wait."""
    if serving_file is None or os.path.exists(serving_file):
        return None
    return "the server is starting"


async def drain(app: web.Application, order: StopOrder) -> int:
    """Answer 503 to new requests (still accepting them: a refused connection tells a client
    nothing) while those in flight finish, until order's deadline; then fail the rest with its
    reason, an error event or a 503. How many were cut."""
    state = app[STATE]
    state.draining = True
    live = state.live_ids
    while live and order.remaining():
        await asyncio.sleep(0.05)
    cut = len(live)
    if cut:
        logger.warning(
            "%d requests still running at the drain deadline; failing them: %s", cut, order.reason
        )
        app[CTX].client.fail_all(order.reason)
        deadline = time.monotonic() + _CLOSE_S  # time for their handlers to send the error
        while live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    return cut


def main(argv: list[str] | None = None) -> int:
    """`python -m frontend.api_server`: how the launcher starts an API server."""
    parser = argparse.ArgumentParser(prog="python -m frontend.api_server")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--listen-fd", type=int, help="an inherited listening socket to serve on (the launcher's)"
    )
    parser.add_argument("--tokenizer-address", action="append", required=True)
    parser.add_argument(
        "--config", required=True, help="the resolved configuration (EngineConfig.encode())"
    )
    parser.add_argument("--engine-pid", type=int)
    parser.add_argument("--parent-pid", type=int)
    parser.add_argument("--api-key")
    parser.add_argument("--max-request-body", type=int, default=DEFAULT_MAX_REQUEST_BODY)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--ready-file")
    parser.add_argument(
        "--serving-file",
        help="answer 503 until the launcher writes this file (once every process is ready)",
    )
    parser.add_argument(
        "--stop-file",
        help="where the launcher writes why and until when to drain, before it sends SIGTERM",
    )
    parser.add_argument(
        "--tokenizer-pid",
        type=int,
        action="append",
        default=[],
        help="fail the requests of a tokenizer process when this pid exits (once "
        "per --tokenizer-address, in the same order)",
    )
    parser.add_argument(
        "--engine-address",
        action="append",
        help="an engine core's address, for POST /reset_prefix_cache (once per data-parallel rank)",
    )
    add_http_args(parser)
    parser.add_argument("--disable-ui", action="store_true")
    add_chat_args(parser)
    args = parser.parse_args(argv)
    start_child_process(process_name(args.index), args.parent_pid)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_api_server(args))


if __name__ == "__main__":
    sys.exit(main())
