"""What serving one stream over HTTP costs against the offline API (issue 17 item 4).

Alternates rounds of: `engine bench single-stream --runs 3` (the offline API: the engine core in
its own process, the text built in the caller), then for each --stream-interval value an
`engine serve` (the default model, or the engine flags after `--`) streaming --requests
/v1/completions requests of 32 random prompt tokens and --new-tokens greedy tokens (EOS ignored),
one at a time, through the engine's own HTTP benchmark client (--client lean: raw socket reads,
scripts/lean_sse.py). Per server: decode tokens/s of
each request (tokens after the first over the time from the first to the last text chunk, as
scripts/llama_server_bench.py counts) and the CPU time per token of each of its processes
(/proc utime + stime over the timed requests: engine core, tokenizer process, API server), of
each of their threads, and of this client. Prints JSON: every run, the medians, each server's
ratio to the offline API in the same rounds, and the machine.

--pairs N measures the ratio the way a drifting machine allows: one `engine serve` (interval 1)
and one offline `LLM` (its engine core in its own process) alive at once, then N pairs of the
same request through each, back to back (which goes first alternates), and the median and
quartiles of the per-pair ratios HTTP / offline. A box whose speed drifts by a third within
minutes moves both halves of a pair alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine_limits import machine_info
from scripts.lean_sse import completion_body, stream_raw
from scripts.llama_server_bench import free_port, start, stop, stream_once, wait_healthy

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(launcher_pid: int) -> dict[str, float]:
    """CPU seconds so far of each child of the launcher, by its /proc comm name."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid:
            found[comm] = (int(fields[11]) + int(fields[12])) / _TICK
    return found


def thread_cpu(launcher_pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of the launcher's children, keyed 'process/thread'.

    Threads of one name in a process (ZeroMQ's I/O threads, OpenMP's workers) are summed.
    """
    found: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != launcher_pid:
                continue
            process = Path(f"/proc/{entry}/comm").read_text().strip()
            for tid in os.listdir(f"/proc/{entry}/task"):
                task = Path(f"/proc/{entry}/task/{tid}")
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                key = f"{process}/{(task / 'comm').read_text().strip()}"
                found[key] = found.get(key, 0.0) + (int(stat[11]) + int(stat[12])) / _TICK
        except OSError:
            continue
    return found


def offline(engine: str, extra: list[str]) -> list[float]:
    out = subprocess.run(
        [engine, "bench", "single-stream", "--runs", "3", *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out[out.index("{") :])["runs"]


async def serve_round(
    engine: str, extra: list[str], interval: int, args: argparse.Namespace, seed: int
) -> dict:
    import aiohttp

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="serving_overhead-")) / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [engine, "serve", "--port", str(port), "--stream-interval", str(interval), *extra]
    proc = start(cmd, log, env)
    try:
        await asyncio.to_thread(wait_healthy, "engine serve", base, proc, log, 600.0)
        rng = np.random.default_rng(seed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async with session.get(f"{base}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            await stream_once(session, base, model, rng.integers(100, 49000, 32).tolist(), 16)
            before, client_before = process_cpu(proc.pid), time.process_time()
            threads_before = thread_cpu(proc.pid)
            runs = []
            for _ in range(args.requests):
                prompt = rng.integers(100, args.max_token_id, 32).tolist()
                if args.client == "lean":
                    body = completion_body(model, prompt, args.new_tokens)
                    runs.append(await stream_raw("127.0.0.1", port, body))
                else:
                    runs.append(await stream_once(session, base, model, prompt, args.new_tokens))
            after, client_after = process_cpu(proc.pid), time.process_time()
            threads_after = thread_cpu(proc.pid)
        tokens = sum(r["tokens"] for r in runs)
        cpu = {k: round((after[k] - before.get(k, 0.0)) / tokens * 1e3, 3) for k in after}
        cpu["client"] = round((client_after - client_before) / tokens * 1e3, 3)
        per_thread = {
            k: round((v - threads_before.get(k, 0.0)) / tokens * 1e3, 3)
            for k, v in threads_after.items()
        }
        return {
            "decode_tok_s": [r["decode_tok_s"] for r in runs],
            "text_chunks": [r["text_chunks"] for r in runs],
            "cpu_ms_per_token": cpu,
            "thread_cpu_ms_per_token": {k: v for k, v in per_thread.items() if v > 0},
        }
    finally:
        stop(proc)


async def pairs(engine: str, args: argparse.Namespace) -> dict:
    """N back-to-back pairs (offline LLM.generate, lean HTTP stream) of the same request."""
    from bench.single_stream import offline_decode
    from config.args import add_engine_args, engine_kwargs
    from frontend.llm import LLM

    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    llm = LLM(**engine_kwargs(engine_parser.parse_args(args.engine_args)))
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="serving_overhead-")) / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = start([engine, "serve", "--port", str(port), *args.engine_args], log, env)
    try:
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_healthy, "engine serve", base, proc, log, 600.0)
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        rng = np.random.default_rng(0)

        async def served(prompt: list[int]) -> float:
            body = completion_body(model, prompt, args.new_tokens)
            return float((await stream_raw("127.0.0.1", port, body))["decode_tok_s"])

        warm = rng.integers(100, args.max_token_id, 32).tolist()
        await served(warm)
        offline_decode(llm, warm, 16)
        rows = []
        for i in range(args.pairs):
            prompt = rng.integers(100, args.max_token_id, 32).tolist()
            if i % 2:
                http = await served(prompt)
                off = offline_decode(llm, prompt, args.new_tokens)
            else:
                off = offline_decode(llm, prompt, args.new_tokens)
                http = await served(prompt)
            rows.append((round(off, 2), http, round(http / off, 4)))
        ratios = [r[2] for r in rows]
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        return {
            "pairs": rows,
            "median_ratio": round(statistics.median(ratios), 4),
            "quartiles": [round(q1, 4), round(q3, 4)],
            "offline_median_tok_s": round(statistics.median(r[0] for r in rows), 2),
            "served_median_tok_s": round(statistics.median(r[1] for r in rows), 2),
            "client": "lean",
            "machine": machine_info(),
        }
    finally:
        stop(proc)
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="timed requests per server")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--max-token-id", type=int, default=49152)
    parser.add_argument(
        "--client",
        choices=("aiohttp", "lean"),
        default="aiohttp",
        help="aiohttp: the engine's benchmark client, which decodes every event's JSON; lean: "
        "raw socket reads like curl -N (scripts/lean_sse.py), so the client takes less of the "
        "machine's CPU from the server",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="instead of rounds: N back-to-back pairs, offline and HTTP (lean), both alive",
    )
    parser.add_argument("engine_args", nargs="*", help="engine flags for both (after --)")
    args = parser.parse_args()
    engine = shutil.which("engine")
    if engine is None:
        raise RuntimeError("no `engine` command on PATH: pip install -e . --no-deps")
    if args.pairs:
        print(json.dumps(asyncio.run(pairs(engine, args)), indent=2))
        return
    offline_runs: list[float] = []
    served: dict[int, list[dict]] = {i: [] for i in args.stream_interval}
    for round_ in range(args.rounds):
        offline_runs += offline(engine, args.engine_args)
        for interval in args.stream_interval:
            served[interval].append(
                asyncio.run(serve_round(engine, args.engine_args, interval, args, round_))
            )
    offline_median = statistics.median(offline_runs)
    result = {
        "offline_tok_s": offline_runs,
        "offline_median": offline_median,
        "client": args.client,
        "served": {},
        "machine": machine_info(),
    }
    for interval, rounds in served.items():
        runs = [t for r in rounds for t in r["decode_tok_s"]]
        median = statistics.median(runs)
        result["served"][f"stream_interval={interval}"] = {
            "rounds": rounds,
            "median_tok_s": median,
            "fraction_of_offline": round(median / offline_median, 3),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
