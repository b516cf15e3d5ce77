"""Watching another process's exit without polling."""

from __future__ import annotations

import asyncio
import subprocess
import time

from ipc.process import wait_for_exit


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
