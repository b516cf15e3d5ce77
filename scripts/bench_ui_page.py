"""What the built-in page costs the engine: `engine bench serve` against a running server with
the page closed, open in headless Chromium (polling every second), and with only its data
endpoints polled, alternating within one run.

    python scripts/bench_ui_page.py --base-url http://127.0.0.1:8000 [--rounds 3] \
        [--server-cpus 0 --viewer-cpus 1] [-- <engine bench serve flags>]

Prints JSON per mode: output tokens/s of every run, their median and its ratio to closed, the
CPU seconds each server role (engine core, tokenizer, API server, all of them) spent per 1000
output tokens (from /proc/<pid>/stat: less sensitive than throughput to other load on a shared
machine), and the viewer's own CPU (Chromium's processes, or this script's poller) per second.

A remote viewer on one machine: --server-cpus pins every thread of the server's processes to
those CPUs and --viewer-cpus pins Chromium (through taskset, so its children too), the poller
thread and the `engine bench serve` client to others, so the browser's drawing does not take the
engine's CPU and the figure is what the page asks of the server. Chromium is Debian's
(/usr/bin/chromium) driven by playwright's Python API.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


SERVER_ROLES = ("engine core", "tokenizer", "API server")


def bench(base_url: str, extra: list[str], cpus: str | None) -> tuple[float, int, float]:
    """(output tokens/s, output tokens, seconds) of one `engine bench serve` run."""
    pin = ["taskset", "-c", cpus] if cpus else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(
            [
                *pin,
                sys.executable,
                "-m",
                "serve.cli",
                "bench",
                "serve",
                "--base-url",
                base_url,
                "--output-json",
                str(out),
                *extra,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        result = json.loads(out.read_text())
        return (
            result["output_tok_s"],
            round(result["output_tok_s"] * result["seconds"]),
            result["seconds"],
        )


def server_pids(base_url: str, key: str | None) -> dict[str, list[int]]:
    """role -> pids, from the page's own process tree (the engine core's workers counted with
    it)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(
        urllib.request.Request(base_url + "/ui/api/stats", headers=headers), timeout=30
    ) as resp:
        procs = json.loads(resp.read())["processes"]
    roles: dict[str, list[int]] = {}
    for p in procs:
        role = "engine core" if p["role"] in ("worker", "helper") else p["role"]
        roles.setdefault(role, []).append(p["pid"])
    return roles


def cpu_list(spec: str) -> set[int]:
    """'0', '0,2' or '0-3' -> the set of CPU numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_threads(pids: list[int], cpus: set[int]) -> None:
    """Every thread of pids onto cpus (threads they start later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of pids so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a viewer's helper process that has exited
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds() -> float:
    """User + system CPU seconds of the calling thread."""
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


def poll_endpoints(
    base_url: str, key: str | None, stop: threading.Event, cpus: set[int] | None, spent: list[float]
) -> None:
    """What an open page asks for, every second, without a browser; its CPU seconds go into
    spent."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while not stop.wait(1.0):
        for path in ("/ui/api/stats", "/ui/api/requests"):
            with urllib.request.urlopen(
                urllib.request.Request(base_url + path, headers=headers), timeout=30
            ) as resp:
                resp.read()
    spent.append(thread_cpu_seconds())


def chromium_wrapper(chromium: str, cpus: str | None, tmp: str) -> str:
    """The browser to launch: chromium itself, or a script running it under taskset."""
    if not cpus:
        return chromium
    path = Path(tmp) / "chromium-pinned"
    path.write_text(f'#!/bin/sh\nexec taskset -c {cpus} {chromium} "$@"\n')
    path.chmod(0o755)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument(
        "--server-cpus",
        help="pin the server's processes to these CPUs (taskset's list: 0 or 0,1 or 0-3)",
    )
    parser.add_argument(
        "--viewer-cpus", help="pin Chromium, the poller and the benchmark client to these CPUs"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="seconds between the page's first answer and the run",
    )
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.api_key:
        extra += ["--api-key", args.api_key]
    from playwright.sync_api import sync_playwright

    results: dict[str, list[float]] = {"closed": [], "open": [], "endpoints": []}
    cpu: dict[str, dict[str, list[float]]] = {
        m: {r: [] for r in (*SERVER_ROLES, "server")} for m in results
    }
    viewer_cpu: dict[str, list[float]] = {m: [] for m in results}
    pids = server_pids(args.base_url, args.api_key)
    pids["server"] = [p for r in SERVER_ROLES for p in pids.get(r, [])]
    if args.server_cpus:
        pin_threads(pids["server"], cpu_list(args.server_cpus))
    viewer_cpus = cpu_list(args.viewer_cpus) if args.viewer_cpus else None
    tmp = tempfile.mkdtemp()
    chromium = chromium_wrapper(args.chromium, args.viewer_cpus, tmp)
    with sync_playwright() as p:
        for round_ in range(args.rounds):
            modes = ["closed", "open", "endpoints"]
            modes = modes[round_ % 3 :] + modes[: round_ % 3]  # no mode always runs first
            for mode in modes:
                browser = stop = poller = None
                viewer: list[int] = []
                poller_cpu: list[float] = []
                if mode == "open":
                    browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    page.goto(args.base_url + "/")
                    if args.api_key:
                        page.fill("#key", args.api_key)
                        page.click("#keyset")
                    page.wait_for_selector("#now td[data-metric]", timeout=30_000)
                    # Chromium's processes: the launcher's children (the browser under
                    # taskset, or sh's exec of it) and theirs.
                    viewer = [c for c in tree(os.getpid())[1:] if "chrom" in _comm(c)]
                    time.sleep(args.settle_s)  # the browser's own start-up work is not the page's
                elif mode == "endpoints":
                    stop = threading.Event()
                    poller = threading.Thread(
                        target=poll_endpoints,
                        args=(args.base_url, args.api_key, stop, viewer_cpus, poller_cpu),
                    )
                    poller.start()
                before = {r: cpu_seconds(pids.get(r, [])) for r in cpu[mode]}
                viewer_before = cpu_seconds(viewer)
                try:
                    rate, tokens, seconds = bench(args.base_url, extra, args.viewer_cpus)
                    results[mode].append(rate)
                    for role, spent in before.items():
                        cpu[mode][role].append(
                            round(1000 * (cpu_seconds(pids.get(role, [])) - spent) / tokens, 4)
                        )
                    viewer_spent = cpu_seconds(viewer) - viewer_before
                finally:
                    if browser is not None:
                        browser.close()
                    if stop is not None:
                        stop.set()
                        poller.join()
                if poller_cpu:
                    viewer_spent = poller_cpu[0]
                viewer_cpu[mode].append(round(viewer_spent / seconds, 4))
                print(
                    f"round {round_ + 1} {mode}: {results[mode][-1]} output tok/s, CPU s per "
                    f"1000 tokens { ({r: v[-1] for r, v in cpu[mode].items()}) }, viewer CPU "
                    f"s/s {viewer_cpu[mode][-1]}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(1.0)
    medians = {m: statistics.median(v) for m, v in results.items()}
    print(
        json.dumps(
            {
                "runs": results,
                "median_output_tok_s": medians,
                "vs_closed": {m: round(v / medians["closed"], 3) for m, v in medians.items()},
                "cpu_s_per_1000_tokens": cpu,
                "median_cpu_s_per_1000_tokens": {
                    m: {r: statistics.median(v) for r, v in roles.items()}
                    for m, roles in cpu.items()
                },
                "viewer_cpu_s_per_s": viewer_cpu,
                "pinned": {"server": args.server_cpus, "viewer": args.viewer_cpus},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
