"""`engine serve` with tensor parallelism: idle cost of the whole process tree, and a worker
killed mid-generation failing its requests and the launcher."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.serve.conftest import Server, kill_mid_generation, pid_gone, wait_until


def _descendants(root: int) -> dict[int, str]:
    """pid -> process name of every process below root."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        names[int(entry.name)] = name
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = names[pid]
                frontier.append(pid)
    return found


def _thread_cpu_seconds(pids) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of pids, by "process/thread" name."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for pid in pids:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = f"{process}/{stat[stat.index('(') + 1 : stat.rindex(')')]}"
            fields = stat.rsplit(")", 1)[1].split()
            totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


@pytest.fixture
def tp2_server(tiny_args):
    server = Server([*tiny_args, "--tensor-parallel-size", "2"])
    assert server.ready, server.stderr
    yield server
    if server.proc.poll() is None:
        server.stop()


def test_idle_process_tree_uses_under_2_percent_of_a_core(tp2_server):
    tree = _descendants(tp2_server.proc.pid)
    assert {"engine-core", "engine-tok-0", "engine-worker-0", "engine-worker-1"} <= set(
        tree.values()
    )
    pids = [tp2_server.proc.pid, *tree]
    time.sleep(2)  # let start-up settle
    # 20 s, two of the engine core's 10 s stats periods. Nothing of ours wakes periodically
    # (pidfds, the signal wake-up pipe, the ring's doorbell): what remains is torch's gloo, whose
    # TCP loop thread wakes every 10 ms in each worker (0.13-0.16 s of the 0.15-0.17 s the tree
    # used in 20 s on one 2-core box).
    before = _thread_cpu_seconds(pids)
    time.sleep(20)
    after = _thread_cpu_seconds(pids)
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    busiest = sorted(((s, n) for n, s in used.items() if s > 0), reverse=True)
    total = sum(used.values())
    assert total < 0.4, f"idle engine processes used {total:.2f} CPU seconds in 20 s: {busiest}"


def test_worker_killed_mid_generation_fails_requests_and_launcher(tp2_server):
    tree = _descendants(tp2_server.proc.pid)
    worker = next(pid for pid, name in tree.items() if name == "engine-worker-1")
    assert kill_mid_generation(tp2_server, worker).status == 503
    assert tp2_server.proc.wait(timeout=30) == 1, tp2_server.stderr
    assert "engine-core" in tp2_server.stderr
    assert wait_until(lambda: all(pid_gone(pid) for pid in tree), timeout=10)
