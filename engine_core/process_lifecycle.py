"""Process naming, liveness and stop orders, shared by the engine's processes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def set_process_name(name: str) -> None:
    """Write name (at most 15 bytes are kept) to /proc/self/comm; a no-op where that is absent."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """True while pid runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the parenthesised name, which may itself hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


async def wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Return once pid has exited: woken by a pidfd where the kernel has them (Linux 5.3+), so
    an idle watcher costs nothing; else polled every poll_s."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        while pid_alive(pid):
            await asyncio.sleep(poll_s)
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        if pid_alive(pid):
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process (status 1) once parent_pid is gone, checked from a daemon thread."""
    def watch() -> None:
        while os.getppid() == parent_pid:  # we are re-parented once it is gone
            time.sleep(interval_s)
        logger.info("parent process %d exited; exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_child_process(name: str, parent_pid: int | None) -> None:
    """Common start of a launched process: log format, process name, exit when the parent goes."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_process_name(name)
    if parent_pid is not None:
        exit_with_parent(parent_pid)


# The exit status of a process that had to cut in-flight requests when it stopped (its drain
# deadline passed, or it was told to stop at once); the launcher then exits non-zero.
EXIT_REQUESTS_CUT = 3


@dataclass(frozen=True)
class StopOrder:
    """Why a process is told to stop, and until when (Unix time) it may drain its requests."""

    reason: str
    deadline: float

    def write(self, path: str) -> None:
        """Write the order where the process reads it on SIGTERM (atomically: it may be reading)."""
        with open(f"{path}.tmp", "w") as f:
            json.dump({"reason": self.reason, "deadline": self.deadline}, f)
        os.replace(f"{path}.tmp", path)

    @classmethod
    def read(cls, path: str | None, drain_timeout: float) -> StopOrder:
        """The launcher's order at path; without one (a SIGTERM sent by someone else), drain for
        drain_timeout seconds from now."""
        try:
            with open(path or "") as f:
                order = json.load(f)
            return cls(str(order["reason"]), float(order["deadline"]))
        except (OSError, ValueError, KeyError, TypeError):
            return cls("the server is shutting down", time.time() + drain_timeout)

    def remaining(self) -> float:
        """Seconds left to drain (0 once the deadline passed)."""
        return max(0.0, self.deadline - time.time())


def host_identity() -> str:
    """Who shares this machine's pids: the boot id and the pid namespace. Two processes with the
    same identity may watch each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""
