"""HTTP single stream: `engine serve` beside llama.cpp's llama-server on the same GGUF file.

Builds llama-server from the llama-cpp-python sdist (scripts/llama_cpp_bench.py's build, in the
same build directory), starts `llama-server -m FILE -t THREADS -c CTX --parallel 1` and
`engine serve` (same file: the default model, or --model; run as the engine runs it by default,
quantized) on free ports with the same thread count, waits until both answer /health, then
alternates rounds: one streamed /v1/completions request to each (the same --prompt-tokens random
token ids, a fresh prompt every round so no prefix cache helps, max_tokens --new-tokens,
temperature 0, ignore_eos), sent by the engine's own HTTP benchmark client (bench/serve.py).
Per request: time to first token (from the send) and decode tokens/s = (tokens - 1) / (time from
the first to the last streamed text chunk), tokens being the server's usage.completion_tokens,
not the chunk count: llama-server streams one chunk per token except where a token ends inside a
UTF-8 character (its bytes wait for the next token's chunk), and engine serve may put several
tokens in one chunk when the client falls behind. Prints JSON: every run, the
medians, the engine's ratio to llama-server, the machine and the threads. Stops both servers at
the end, also on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine_limits import machine_info
from bench.serve import _one  # the engine's streamed-request client
from config.default_model import cache_root, find_default_gguf
from scripts.lean_sse import completion_body
from scripts.llama_cpp_bench import build_llama_cpp

SERVERS = ("llama-server", "engine serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server in its own process group (stopped as a group), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def wait_healthy(name: str, base: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited ({proc.returncode}) before it was healthy:\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{name} not healthy after {timeout:.0f} s (log: {log})")


async def stream_once(
    session, base: str, model: str, prompt: list[int], new_tokens: int
) -> dict[str, float | int]:
    """One streamed /v1/completions request: TTFT, decode tok/s, tokens and text chunks."""
    body = completion_body(model, prompt, new_tokens)
    r = await _one(session, f"{base}/v1/completions", {}, body)
    if r.error is not None or r.ttft is None:
        raise RuntimeError(f"{base}: {r.error or 'no text streamed'}")
    decode_s = sum(r.itls)  # first to last text chunk
    return {
        "ttft_ms": round(r.ttft * 1e3, 2),
        "decode_tok_s": round((r.output_tokens - 1) / decode_s, 2) if decode_s else 0.0,
        "tokens": r.output_tokens,
        "text_chunks": len(r.itls) + 1,
        "e2e_s": round(r.e2e, 3),
    }


async def rounds(bases: dict[str, str], args: argparse.Namespace) -> dict[str, list[dict]]:
    import aiohttp

    rng = np.random.default_rng(args.seed)
    runs: dict[str, list[dict]] = {name: [] for name in SERVERS}
    # A fresh connection per request: a kept-alive one that llama-server's HTTP library has
    # closed in the meantime ends the next stream with ServerDisconnectedError.
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(force_close=True)
    ) as session:
        models = {}
        for name, base in bases.items():
            async with session.get(f"{base}/v1/models") as resp:
                models[name] = (await resp.json())["data"][0]["id"]
        for name, base in bases.items():  # warm-up, not counted
            await stream_once(
                session,
                base,
                models[name],
                rng.integers(100, args.max_token_id, args.prompt_tokens).tolist(),
                16,
            )
        for run in range(args.runs):
            prompt = rng.integers(100, args.max_token_id, args.prompt_tokens).tolist()
            order = SERVERS if run % 2 == 0 else SERVERS[::-1]  # neither always goes first
            for name in order:
                runs[name].append(
                    await stream_once(session, bases[name], models[name], prompt, args.new_tokens)
                )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file (default model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="llama-server -t and the engine's OMP_NUM_THREADS (default: torch's)",
    )
    parser.add_argument("--ctx", type=int, default=1024, help="llama-server -c")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-token-id",
        type=int,
        default=49152,
        help="prompt ids are drawn from [100, max) (default: the default model's vocab)",
    )
    parser.add_argument("--llama-cpp-version", default=None, help="llama-cpp-python sdist version")
    args = parser.parse_args()
    gguf = (args.model or find_default_gguf()).resolve()
    bin_dir = build_llama_cpp(cache_root() / "llama.cpp", args.llama_cpp_version, ("llama-server",))
    engine = shutil.which("engine")
    if engine is None:
        raise RuntimeError("no `engine` command on PATH: pip install -e . --no-deps")
    ports = {name: free_port() for name in SERVERS}
    bases = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    logs = Path(tempfile.mkdtemp(prefix="llama_server_bench-"))
    cmds = {
        "llama-server": [
            str(bin_dir / "llama-server"),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["llama-server"]),
            "-t",
            str(args.threads),
            "-c",
            str(args.ctx),
            "--parallel",
            "1",
        ],
        "engine serve": [
            engine,
            "serve",
            *([str(gguf)] if args.model else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["engine serve"]),
        ],
    }
    envs = {
        "llama-server": None,
        "engine serve": os.environ | {"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"},
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in SERVERS:
            procs[name] = start(cmds[name], logs / f"{name.replace(' ', '_')}.log", envs[name])
        for name in SERVERS:
            wait_healthy(
                name,
                bases[name],
                procs[name],
                logs / f"{name.replace(' ', '_')}.log",
                args.startup_timeout,
            )
        runs = asyncio.run(rounds(bases, args))
    finally:
        for proc in procs.values():
            stop(proc)
    medians = {
        name: {
            key: statistics.median(r[key] for r in runs[name])
            for key in ("ttft_ms", "decode_tok_s")
        }
        for name in SERVERS
    }
    result = {
        "workload": "HTTP single stream, streamed /v1/completions",
        "machine": machine_info(),
        "model": str(gguf),
        "llama_server": cmds["llama-server"][0],
        "engine_serve": " ".join(cmds["engine serve"]),
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "token_counting": "tokens = usage.completion_tokens, not chunks; decode_tok_s = "
        "(tokens - 1) / (first to last streamed text chunk). llama-server "
        "streams one chunk per token, except that a token ending inside a "
        "UTF-8 character waits for the next one's chunk; engine serve may put "
        "several tokens in a chunk when the client falls behind. So "
        "text_chunks may be below tokens",
        "ignore_eos_took_effect": all(
            r["tokens"] == args.new_tokens for name in SERVERS for r in runs[name]
        ),
        "runs": runs,
        "median": medians,
        "engine_over_llama_server": {
            "decode_tok_s": round(
                medians["engine serve"]["decode_tok_s"] / medians["llama-server"]["decode_tok_s"], 2
            ),
            "ttft": round(
                medians["engine serve"]["ttft_ms"] / medians["llama-server"]["ttft_ms"], 2
            ),
        },
        "server_logs": str(logs),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
