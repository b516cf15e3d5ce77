"""The `engine` command: generate, bench, core, serve."""

from __future__ import annotations

import argparse
import os
import sys

from config.args import add_engine_args, engine_kwargs
from frontend.chat_args import ChatOptions, add_chat_args
from frontend.http_options import (
    HttpOptions,
    add_http_args,
    add_vllm_frontend_args,
    refuse_vllm_serve_flags,
)


def _generate(args: argparse.Namespace) -> int:
    from frontend.llm import LLM
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**engine_kwargs(args))
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for out in outputs:
        for completion in out.outputs:
            text = completion.text if args.chat else (out.prompt or "") + completion.text
            print(text, flush=True)
    return 0


def _core(args: argparse.Namespace) -> int:
    from engine_core.core_proc import run_engine_core

    return run_engine_core(args.listen, engine_kwargs(args))  # resolved there, after its signals


def _serve(args: argparse.Namespace) -> int:
    from serve.launcher import serve

    refuse_vllm_serve_flags(args)
    chat = ChatOptions.from_args(args)  # a bad flag fails before anything starts
    http = HttpOptions.from_args(args)
    if http.uds and args.api_server_count > 1:
        raise ValueError(
            f"--uds serves one API server; --api-server-count "
            f"{args.api_server_count} needs --host/--port"
        )
    return serve(
        engine_kwargs(args),
        args.tokenizer_workers,
        args.tokenizer_listen,
        args.shutdown_timeout,
        args.startup_timeout,
        args.api_server_count,
        args.host,
        args.port,
        "\n".join(args.api_key) if args.api_key else os.environ.get("VLLM_API_KEY") or None,
        args.max_request_body,
        chat,
        disable_ui=args.disable_ui,
        headless=args.headless,
        http=http,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="engine", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts and print it")
    gen.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from bench.commands import add_bench_parser  # the workloads load when one runs

    add_bench_parser(sub)

    core = sub.add_parser(
        "core",
        help="run the engine core alone (headless) on a ZeroMQ address; protocol: docs/protocol.md",
    )
    core.add_argument(
        "--listen",
        required=True,
        help="address to bind: tcp://HOST:PORT (port * picks a free one) or ipc:///path/to/socket",
    )
    add_engine_args(core)
    core.set_defaults(func=_core)

    srv = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP API servers, the "
        "tokenizer processes and the engine core (docs/serve.md)",
    )
    http = srv.add_argument_group("HTTP server options")
    procs = srv.add_argument_group("process options")
    add_chat_args(srv.add_argument_group("chat and tool calling options"))
    http.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the API servers listen on (default 127.0.0.1; 0.0.0.0 for every interface)",
    )
    http.add_argument(
        "--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free one)"
    )
    http.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' with one of these keys on the "
        "/v1 routes and a few others (default: $VLLM_API_KEY, keys one per line; a key on "
        "the command line shows in `ps` to every user of the machine, the variable does not; "
        "docs/serve.md names the open routes)",
    )
    http.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="API server processes sharing the launcher's listening socket "
        "(default 1; "
        "0: none, clients speak to the tokenizer processes)",
    )
    http.add_argument(
        "--max-request-body",
        type=int,
        default=16 * 1024 * 1024,
        metavar="BYTES",
        help="largest request body; larger ones get 413 (default 16 MiB)",
    )
    http.add_argument(
        "--disable-ui",
        action="store_true",
        help="do not serve the built-in page at / and /ui (docs/ui.md)",
    )
    procs.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's data-parallel engine cores (ranks "
        "--data-parallel-start-rank on) and register them with the first "
        "host at --data-parallel-address:--data-parallel-rpc-port; no API "
        "server (docs/scale-out.md)",
    )
    procs.add_argument(
        "--tokenizer-workers",
        type=int,
        default=1,
        metavar="M",
        help="tokenizer processes (default 1)",
    )
    procs.add_argument(
        "--tokenizer-listen",
        action="append",
        metavar="ADDR",
        help="address a tokenizer process binds, once per worker (default: "
        "ipc:// sockets in a temporary directory)",
    )
    procs.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish on SIGTERM/SIGINT",
    )
    procs.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds every process may take to report ready",
    )
    add_http_args(http)
    add_engine_args(srv, model_positional=True)
    add_vllm_frontend_args(srv)
    srv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `engine` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
