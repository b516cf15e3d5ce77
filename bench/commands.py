"""The `engine bench` subcommand: its workloads' flags, and one runner that prints each
workload's figures as JSON.

serve/cli.py imports this module only to build its parser; a workload's module (and torch,
numpy, aiohttp) is imported when that workload runs: `engine core` must block its stop signals
before any library starts threads.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench import device, device_variants, serve, startup
from config.args import add_engine_args

# Workload -> (module, function) computing its figures from the parsed arguments.
_WORKLOADS = {
    "throughput": ("bench.offline", "bench_throughput"),
    "prefix-shared": ("bench.offline", "bench_prefix_shared"),
    "single-stream": ("bench.single_stream", "bench_single_stream"),
    "null-model": ("bench.offline", "bench_null_model"),
    "structured": ("bench.structured", "bench_structured"),
    "device": ("bench.device", "bench_device"),
    "startup": ("bench.startup", "bench_startup"),
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Add `engine bench` and its workloads to the `engine` command's subparsers."""
    bench = sub.add_parser("bench", help="run a benchmark workload of shared/BENCHMARKS.md")
    workloads = bench.add_subparsers(dest="workload", required=True)
    for name, text in (
        ("throughput", "offline-mixed, against transformers"),
        ("prefix-shared", "prefix caching on and off"),
        ("single-stream", "one request's decode speed"),
        ("null-model", "engine overhead, in-process and over ZeroMQ"),
        (
            "structured",
            "offline-mixed constrained by a JSON schema against "
            "unconstrained, and grammar-compile TTFT",
        ),
    ):
        offline = workloads.add_parser(name, help=text)
        offline.add_argument(
            "--in-process",
            action="store_true",
            help="run the engine core in this process (default: its own process)",
        )
        offline.add_argument(
            "--no-hf", action="store_true", help="skip the transformers comparison"
        )
        offline.add_argument("--runs", type=int, default=3, help="repetitions")
        if name == "throughput":
            offline.add_argument(
                "--small-moe",
                action="store_true",
                help="run on a random-weight small Qwen3-MoE (hidden 512, 4 layers, 16 experts, "
                "top-2; bench/moe_model.py, written once to the cache) instead of --model",
            )
        offline.add_argument("--output-json", help="also write the figures to this file")
        add_engine_args(offline)
        offline.set_defaults(func=run_workload)
    dev = workloads.add_parser(
        "device",
        help="batch-1 and batch-64 decode of a Llama-3-8B-"
        "shaped model (dummy weights) against the memory-bandwidth limit",
        conflict_handler="resolve",  # the workload's --quantization replaces the engine's
    )
    device.add_arguments(dev)
    add_engine_args(dev)
    device_variants.add_quantization_argument(dev)
    dev.set_defaults(func=run_workload)
    up = workloads.add_parser(
        "startup",
        help="engine serve's time from the command to its "
        "first answer, with each start-up phase's time",
    )
    startup.add_arguments(up)
    up.set_defaults(func=run_workload)
    srv = workloads.add_parser(
        "serve", help="serving-poisson over HTTP against any OpenAI-compatible server"
    )
    serve.add_arguments(srv)
    srv.set_defaults(func=run_serve)


def run_workload(args: argparse.Namespace) -> int:
    """Run the chosen offline or device workload and print its figures; 1 where a part of it
    failed (a device variant's error is among the figures)."""
    import importlib

    module, function = _WORKLOADS[args.workload]
    result = getattr(importlib.import_module(module), function)(args)
    print_figures(result, args.output_json)
    return 1 if any("error" in v for v in result.get("variants", ())) else 0


def run_serve(args: argparse.Namespace) -> int:
    """Run serving-poisson and print its figures; 1 if any request failed."""
    import asyncio

    result = asyncio.run(serve.run(args))
    print_figures(result, args.output_json)
    return 0 if result["failed"] == 0 else 1


def print_figures(result: dict[str, Any], output_json: str | None) -> None:
    """Print a workload's figures as JSON, and write them to output_json when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if output_json:
        with open(output_json, "w") as f:
            f.write(text + "\n")
