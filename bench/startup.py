"""`engine bench startup`: how long `engine serve` takes from the command to its first answer.

Each run spawns `engine serve [serve flags]` on a free port, sends a one-token completion every
50 ms from the moment the process starts, and times the first 200 answer; then stops the server
(SIGTERM) and waits for it to exit. Every line the server prints is kept with the time it
arrived, so the per-phase lines the processes log at start-up ("... in 1.23 s") come back with
the figure, as the breakdown of where the time went.

    engine bench startup [--runs 3] [--output-json F] [-- <engine serve flags>]

Without serve flags it starts the default model (cached after its first conversion).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from bench.machine_limits import machine_info

# A start-up phase as the processes log it: "<what> in 1.23 s".
_PHASE = re.compile(r"(?:INFO|engine serve:)\s+(?P<text>.*\bin (?P<s>\d+(?:\.\d+)?) s\b.*)$")
_POLL_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The startup workload's flags."""
    parser.add_argument("--runs", type=int, default=3, help="start-ups to time")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a start-up may take before the run fails",
    )
    parser.add_argument("--output-json", help="also write the figures to this file")
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after --: flags for engine serve (default: the default model)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str, body: bytes) -> bool:
    """Whether a one-token completion succeeds now."""
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status == 200 and bool(json.loads(resp.read())["choices"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return False


def _served_model(serve_args: list[str]) -> str | None:
    """--served-model-name or --model from the serve flags, for the request's model field."""
    for flag in ("--served-model-name", "--model"):
        if flag in serve_args:
            return serve_args[serve_args.index(flag) + 1]
    return None


def one_startup(serve_args: list[str], timeout: float) -> dict[str, Any]:
    """Start `engine serve`, time its first answer, stop it; the figures and its phase lines."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 1}
    if (model := _served_model(serve_args)) is not None:
        body["model"] = model
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "serve.cli", "serve", *serve_args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((round(time.monotonic() - start, 3), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    encoded = json.dumps(body).encode()
    first_answer = None
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            if _answers(url, encoded):
                first_answer = time.monotonic() - start
                break
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
    if first_answer is None:
        tail = "\n".join(text for _, text in lines[-20:])
        raise RuntimeError(
            f"engine serve did not answer within {timeout:.0f} s "
            f"(exit code {proc.returncode}):\n{tail}"
        )
    ready = next((t for t, text in lines if text.startswith("engine serve: ready")), None)
    phases = [f"{t:7.3f}  {m['text']}" for t, text in lines if (m := _PHASE.search(text))]
    return {"first_answer_s": round(first_answer, 3), "ready_line_s": ready, "phases": phases}


def bench_startup(args: argparse.Namespace) -> dict[str, Any]:
    """The startup workload: --runs start-ups of `engine serve`, one after another."""
    serve_args = [a for a in args.serve_args if a != "--"]
    load = os.getloadavg()  # other work on the machine slows every phase
    runs = []
    for i in range(args.runs):
        run = one_startup(serve_args, args.timeout)
        print(f"run {i + 1}: first answer {run['first_answer_s']} s", file=sys.stderr, flush=True)
        runs.append(run)
    firsts = [r["first_answer_s"] for r in runs]
    return {
        "workload": "startup",
        "machine": machine_info(),
        "serve_args": serve_args,
        "first_answer_s": firsts,
        "median_first_answer_s": statistics.median(firsts),
        "load_average_before": load,
        "runs": runs,
    }
