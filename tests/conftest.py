"""Test-session set-up: Triton kernels run under the interpreter when no GPU is present, and
every test phase has a time limit, so a hang fails one test (with every thread's stack printed)
instead of stalling the whole run until CI's own limit."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading

import pytest
import torch

# Must happen before triton is imported by the kernel modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Seconds one setup, call or teardown may take; the slowest test takes about a minute.
PHASE_LIMIT_S = float(os.environ.get("ENGINE_TEST_TIMEOUT", "300"))


class PhaseTimeout(Exception):
    """A test phase ran past PHASE_LIMIT_S."""


@contextlib.contextmanager
def _time_limit(what: str):
    if PHASE_LIMIT_S <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        sys.stderr.write(f"\n{what} ran past {PHASE_LIMIT_S:.0f} s; every thread's stack:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        raise PhaseTimeout(f"{what} ran past {PHASE_LIMIT_S:.0f} s (ENGINE_TEST_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, PHASE_LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _time_limit(f"setup of {item.nodeid}"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _time_limit(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _time_limit(f"teardown of {item.nodeid}"):
        return (yield)
