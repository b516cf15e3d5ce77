"""`engine bench serve`: workload serving-poisson against any OpenAI-compatible server.

The `engine` command imports this module for its flags, so heavy imports (numpy, aiohttp) wait
for run(): `engine core` must block its stop signals before any library starts threads.

Streams /v1/completions requests (random token-id prompts, EOS ignored, greedy) arriving as a
Poisson process at --rate requests/s (inf: all at once) and reports time to first token,
inter-token latency and end-to-end latency percentiles, output tokens/s and the request rate
achieved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, from its send time)."""

    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


async def _one(session, url: str, headers: dict[str, str], body: dict[str, Any]) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", ())):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except Exception as e:  # a benchmark reports failures rather than stopping
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - start
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    arr = np.array(values) * 1e3
    return {f"p{p}_ms": round(float(np.percentile(arr, p)), 2) for p in (50, 90, 99)} | {
        "mean_ms": round(float(arr.mean()), 2)
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Send the workload and summarise it."""
    import aiohttp
    import numpy as np

    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, args.num_prompts)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_prompts)
    gaps = (
        np.zeros(args.num_prompts)
        if args.rate == float("inf")
        else rng.exponential(1.0 / args.rate, args.num_prompts)
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = args.model
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        tasks = []
        start = time.perf_counter()
        for n_in, n_out, gap in zip(prompt_lens, output_lens, gaps):
            await asyncio.sleep(gap)
            body = {
                "model": model,
                "prompt": rng.integers(args.min_token_id, args.max_token_id, int(n_in)).tolist(),
                "max_tokens": int(n_out),
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            tasks.append(
                asyncio.create_task(_one(session, f"{base}/v1/completions", headers, body))
            )
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "workload": "serving-poisson",
        "base_url": base,
        "model": model,
        "rate_requested": args.rate if args.rate != float("inf") else "inf",
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "seconds": round(elapsed, 2),
        "request_rate_achieved": round(len(ok) / elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "ttft": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl": _percentiles([x for r in ok for x in r.itls]),
        "e2e": _percentiles([r.e2e for r in ok]),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `engine bench serve`."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(32, 256),
        metavar=("MIN", "MAX"),
        help="prompt lengths, uniform (default 32 256)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="output lengths, uniform (default 16 128)",
    )
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-token-id",
        type=int,
        default=100,
        help="random prompt ids are drawn from [min, max) (no special tokens)",
    )
    parser.add_argument("--max-token-id", type=int, default=49152)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--output-json", help="also write the figures to this file")
