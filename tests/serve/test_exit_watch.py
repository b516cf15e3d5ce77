"""The launcher's supervision sleeps on pidfds and the signal wake-up pipe: a child's exit and a
signal each end its wait at once, and off the main thread it falls back to a short sleep."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

from serve.supervision import POLL_S, ExitWatch


def _tiers(*procs: subprocess.Popen) -> list[list]:
    return [[SimpleNamespace(name=f"child-{p.pid}", popen=p) for p in procs]]


def test_a_child_exit_ends_the_wait():
    quick, slow = subprocess.Popen(["sleep", "0.5"]), subprocess.Popen(["sleep", "30"])
    try:
        with ExitWatch(_tiers(slow, quick)) as watch:
            start = time.monotonic()
            watch.wait(10.0)
            assert 0.3 < time.monotonic() - start < 5.0
            assert quick.poll() == 0
    finally:
        slow.kill()
        slow.wait()


def test_a_signal_ends_the_wait_and_the_old_wakeup_fd_comes_back():
    child = subprocess.Popen(["sleep", "30"])
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, _frame: got.append(s))
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    try:
        with ExitWatch(_tiers(child)) as watch:
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            start = time.monotonic()
            watch.wait(10.0)
            assert got == [signal.SIGUSR1]
            assert time.monotonic() - start < 5.0
        assert signal.set_wakeup_fd(before) == before  # what it found is restored
    finally:
        signal.signal(signal.SIGUSR1, old)
        child.kill()
        child.wait()


def test_off_the_main_thread_it_sleeps_briefly():
    child = subprocess.Popen(["sleep", "30"])
    waited: list[float] = []

    def run() -> None:
        with ExitWatch(_tiers(child)) as watch:
            start = time.monotonic()
            watch.wait(10.0)
            waited.append(time.monotonic() - start)

    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(10)
        assert waited and waited[0] < POLL_S + 1.0
    finally:
        child.kill()
        child.wait()
