"""Watching another process's exit without polling; naming threads for top -H and perf."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from ipc.process import set_thread_name, wait_for_exit


def test_wait_for_exit_returns_when_the_process_exits():
    async def main(pid: int) -> float:
        await wait_for_exit(pid, poll_s=5.0)  # a poll would only notice after 5 s
        return time.monotonic() - start

    start = time.monotonic()
    proc = subprocess.Popen(["sleep", "0.6"])
    elapsed = asyncio.run(main(proc.pid))
    proc.wait()
    assert 0.5 < elapsed < 2.0


def test_wait_for_exit_of_a_process_already_gone():
    proc = subprocess.Popen(["true"])
    proc.wait()
    asyncio.run(asyncio.wait_for(wait_for_exit(proc.pid), timeout=2.0))


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_set_thread_name_names_the_calling_thread_only():
    names: dict[str, str] = {}

    def run() -> None:
        set_thread_name()  # its Python name, cut to the 15 bytes Linux keeps
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/comm") as f:
            names["thread"] = f.read().strip()

    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        before = f.read()
    t = threading.Thread(target=run, name="engine-core-io-and-more")
    t.start()
    t.join()
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read() == before
    assert names["thread"] == "engine-core-io-"


def test_watch_parent_notices_the_parent_exit_on_its_pidfd():
    """A child whose parent exits hears of it at once, though it would poll only every 5 s."""
    code = (
        "import os, subprocess, sys, time\n"
        "from ipc.process import watch_parent\n"
        "if sys.argv[1] == 'parent':\n"
        "    subprocess.Popen([sys.executable, '-c', sys.argv[2], 'child', str(os.getpid())])\n"
        "    time.sleep(0.5)\n"
        "else:\n"
        "    watch_parent(int(sys.argv[2]), interval_s=5.0,\n"
        "                 on_exit=lambda why: (print(why, flush=True), os._exit(0)))\n"
        "    print('watching', flush=True)\n"
        "    time.sleep(30)\n"
    )
    start = time.monotonic()
    parent = subprocess.run(
        [sys.executable, "-c", code, "parent", code],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert parent.returncode == 0, parent.stderr
    # The child's lines come through the pipe it shares with the parent until it exits.
    lines = parent.stdout.splitlines()
    assert lines[0] == "watching" and "exited" in lines[1], parent.stdout
    assert time.monotonic() - start < 4.5
