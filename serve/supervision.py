"""Supervising the launched tiers: noticing a child that exited, and stopping the tiers in
reverse start order, each front tier draining its requests until the StopOrder's deadline."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from ipc.process import EXIT_REQUESTS_CUT, StopOrder
from serve.child import Child, LaunchError

# How long a child may take to exit after SIGTERM once its drain deadline has passed.
STOP_TIMEOUT_S = 10.0
# Without pidfds (or off the main thread, where no signal wake-up pipe can be set): the period
# at which ExitWatch.wait looks at the children and the signals.
POLL_S = 0.2


class ExitWatch:
    """Sleeps until a child exits or a signal comes: one select over a pidfd per child and the
    signal wake-up pipe (signal.set_wakeup_fd), so supervising idle children costs no wake-ups.
    Where the kernel has no pidfds, or off the main thread, it sleeps POLL_S instead. Use it as
    a context manager: leaving restores the previous wake-up descriptor."""

    def __init__(self, tiers: list[list[Child]]) -> None:
        self._fds: list[int] = []
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        try:
            for tier in tiers:
                for child in tier:
                    self._fds.append(os.pidfd_open(child.popen.pid))
            pipe = os.pipe()
            self._fds += pipe  # closed with the pidfds
            for fd in pipe:
                os.set_blocking(fd, False)
            self._old_wakeup = signal.set_wakeup_fd(pipe[1], warn_on_full_buffer=False)
            self._pipe = pipe
        except (AttributeError, OSError, ValueError):  # no pidfds; a child gone; not main thread
            self.close()

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, timeout: float) -> None:
        """Return once a child has exited or a signal came (or after timeout seconds)."""
        if self._pipe is None:
            time.sleep(min(timeout, POLL_S))
            return
        ready, _, _ = select.select(self._fds[:-1], [], [], timeout)  # not the write end
        if self._pipe[0] in ready:
            try:
                os.read(self._pipe[0], 512)  # the signals' bytes: the handlers ran already
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            self._pipe = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []


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
