"""What the built-in page costs the engine: `engine bench serve` against a running server with
the page closed, open in headless Chromium (polling every second), and with only its data
endpoints polled, alternating within one run.

    python scripts/bench_ui_page.py --base-url http://127.0.0.1:8000 [--rounds 3] \
        [-- <engine bench serve flags>]

Prints JSON per mode: output tokens/s of every run, their median and its ratio to closed, and
the CPU seconds the engine core and the API servers spent per 1000 output tokens (from
/proc/<pid>/stat: less sensitive than throughput to other load on a shared machine). Chromium is
Debian's (/usr/bin/chromium) driven by playwright's Python API.
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

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def bench(base_url: str, extra: list[str]) -> tuple[float, int, float]:
    """(output tokens/s, output tokens, seconds) of one `engine bench serve` run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "frontend.cli", "bench", "serve", "--base-url",
                        base_url, "--output-json", str(out), *extra], check=True,
                       stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        return result["output_tok_s"], round(result["output_tok_s"] * result["seconds"]), \
            result["seconds"]


def server_pids(base_url: str, key: str | None) -> dict[str, list[int]]:
    """role -> pids, from the page's own process tree."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(base_url + "/ui/api/stats",
                                                       headers=headers), timeout=30) as resp:
        procs = json.loads(resp.read())["processes"]
    roles: dict[str, list[int]] = {}
    for p in procs:
        roles.setdefault(p["role"], []).append(p["pid"])
    return roles


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of pids so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def poll_endpoints(base_url: str, key: str | None, stop: threading.Event) -> None:
    """What an open page asks for, every second, without a browser."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while not stop.wait(1.0):
        for path in ("/ui/api/stats", "/ui/api/requests"):
            with urllib.request.urlopen(urllib.request.Request(base_url + path, headers=headers),
                                        timeout=30) as resp:
                resp.read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.api_key:
        extra += ["--api-key", args.api_key]
    from playwright.sync_api import sync_playwright

    results: dict[str, list[float]] = {"closed": [], "open": [], "endpoints": []}
    cpu: dict[str, dict[str, list[float]]] = {m: {"engine core": [], "API server": []}
                                              for m in results}
    pids = server_pids(args.base_url, args.api_key)
    with sync_playwright() as p:
        for round_ in range(args.rounds):
            modes = ["closed", "open", "endpoints"]
            modes = modes[round_ % 3:] + modes[:round_ % 3]  # no mode always runs first
            for mode in modes:
                browser = stop = poller = None
                if mode == "open":
                    browser = p.chromium.launch(executable_path=args.chromium,
                                                args=CHROMIUM_ARGS)
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    page.goto(args.base_url + "/")
                    if args.api_key:
                        page.fill("#key", args.api_key)
                        page.click("#keyset")
                    page.wait_for_selector("#now td[data-metric]", timeout=30_000)
                elif mode == "endpoints":
                    stop = threading.Event()
                    poller = threading.Thread(target=poll_endpoints,
                                              args=(args.base_url, args.api_key, stop))
                    poller.start()
                before = {r: cpu_seconds(pids[r]) for r in cpu[mode]}
                try:
                    rate, tokens, _ = bench(args.base_url, extra)
                    results[mode].append(rate)
                    for role, spent in before.items():
                        cpu[mode][role].append(
                            round(1000 * (cpu_seconds(pids[role]) - spent) / tokens, 4))
                finally:
                    if browser is not None:
                        browser.close()
                    if stop is not None:
                        stop.set()
                        poller.join()
                print(f"round {round_ + 1} {mode}: {results[mode][-1]} output tok/s, CPU s per "
                      f"1000 tokens {({r: v[-1] for r, v in cpu[mode].items()})}",
                      file=sys.stderr, flush=True)
                time.sleep(1.0)
    medians = {m: statistics.median(v) for m, v in results.items()}
    print(json.dumps({"runs": results, "median_output_tok_s": medians,
                      "vs_closed": {m: round(v / medians["closed"], 3)
                                    for m, v in medians.items()},
                      "cpu_s_per_1000_tokens": cpu,
                      "median_cpu_s_per_1000_tokens": {
                          m: {r: statistics.median(v) for r, v in roles.items()}
                          for m, roles in cpu.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
