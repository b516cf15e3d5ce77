"""Supervising the launched tiers: noticing a child that exited, and stopping the tiers in
reverse start order, each front tier draining its requests until the StopOrder's deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

from ipc.process import EXIT_REQUESTS_CUT, StopOrder
from serve.child import Child, LaunchError

# How long a child may take to exit after SIGTERM once its drain deadline has passed.
STOP_TIMEOUT_S = 10.0


def check_children(tiers: list[list[Child]], when: str = "unexpectedly") -> None:
    """Raise LaunchError naming the first child that has exited."""
    for tier in tiers:
        for child in tier:
            code = child.popen.poll()
            if code is not None:
                raise LaunchError(
                    f"{child.name} (pid {child.popen.pid}) exited {when} with code {code}"
                )


def stop_tiers(
    tiers: list[list[Child]], order: StopOrder, before_engine_cores: Callable[[], None]
) -> list[str]:
    """SIGTERM the tiers last to first, waiting for each: the tiers in front of the engine
    cores (tier 0) until order's deadline and STOP_TIMEOUT_S more, then SIGKILL.
    before_engine_cores() runs before tier 0 stops. The children that cut requests."""
    cut = []
    for depth, tier in reversed(list(enumerate(tiers))):
        if depth == 0:  # nobody sends them requests now
            before_engine_cores()
        timeout = STOP_TIMEOUT_S + (order.remaining() if depth else 0.0)
        for child in tier:
            if child.popen.poll() is None:
                child.popen.terminate()
        deadline = time.monotonic() + timeout
        for child in tier:
            try:
                code = child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"engine serve: {child.name} did not stop in {timeout:.0f} s; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                child.popen.kill()
                code = child.popen.wait()
            if depth and code in (EXIT_REQUESTS_CUT, -signal.SIGKILL):
                cut.append(child.name)
    return cut
