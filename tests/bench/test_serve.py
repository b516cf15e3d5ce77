"""`engine bench serve` against a real `engine serve`: every request succeeds and the figures
add up."""

from __future__ import annotations

import argparse
import asyncio

from bench import serve as bench_serve
from tests.api.conftest import API_KEY, server, tiny_model  # noqa: F401 (fixtures)


def test_bench_serve_reports_latencies(server):
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.api_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "6",
            "--rate",
            "50",
            "--prompt-len",
            "8",
            "16",
            "--output-len",
            "4",
            "8",
        ]
    )
    result = asyncio.run(bench_serve.run(args))
    assert result["failed"] == 0, result["errors"]
    assert result["requests"] == 6 and result["output_tok_s"] > 0
    assert result["ttft"]["p50_ms"] <= result["e2e"]["p50_ms"]
    assert result["itl"]["p99_ms"] >= result["itl"]["p50_ms"] > 0
