"""Process plumbing shared by every process of the engine: starting a child module, process
names, liveness, the one parent-death watch, stop orders."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

logger = logging.getLogger(__name__)

# The directory holding the project's packages, so that a child imports this very copy.
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
_PR_SET_PDEATHSIG = 1


def spawn_module(
    module: str,
    args: list[str],
    *,
    extra_env: dict[str, str] | None = None,
    own_session: bool = False,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen:
    """Run `python -P -m module args` with this project first on PYTHONPATH and extra_env added
    to our environment. -P: `python -m` would otherwise put the working directory ahead of
    PYTHONPATH, so a folder of the user's named like one of ours (config/, metrics/) would be
    imported in the child instead, or another checkout when run from inside it. own_session
    keeps terminal signals (Ctrl-C) away from it, for a supervisor that stops its children in
    its own order."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-P", "-m", module, *args],
        env=env,
        start_new_session=own_session,
        pass_fds=pass_fds,
    )


def set_process_name(name: str) -> None:
    """Write name (at most 15 bytes are kept) to /proc/self/comm, the name ps and top show (the
    main thread's, as prctl(PR_SET_NAME) on it); a no-op where that is absent."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def set_thread_name(name: str | None = None) -> None:
    """Give the calling thread an OS name (at most 15 bytes; default: its Python name), so that
    `top -H`, perf and /proc/<pid>/task/*/comm tell the engine's threads apart; a no-op where
    /proc is absent."""
    name = threading.current_thread().name if name is None else name
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
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


def _wait_for_parent(parent_pid: int, poll_s: float) -> None:
    """Block until parent_pid, our parent, is gone: on its pidfd where the kernel has them (no
    wake-ups while it lives), else by polling our parent pid every poll_s (we are re-parented
    once it is gone)."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # no pidfds, or the parent is gone already
        fd = None
    try:
        # Still our parent once the descriptor is held: not a reused pid.
        if fd is not None and os.getppid() == parent_pid:
            select.select([fd], [], [])
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
    finally:
        if fd is not None:
            os.close(fd)


def watch_parent(
    parent_pid: int,
    *,
    on_exit: Callable[[str], None] | None = None,
    grace_s: float = 10.0,
    lifeline: Connection | None = None,
    kill_with_parent: bool = False,
    interval_s: float = 0.5,
) -> None:
    """Exit this process (status 1) once parent_pid is gone, noticed by a daemon thread.

    on_exit: called first with the reason (e.g. to drain), then the process has grace_s seconds
    to exit on its own. lifeline: the read end of a pipe whose only writer is the parent; its EOF
    is the parent's death (else the thread waits on the parent's pidfd, or without pidfds
    polls our parent pid every interval_s: we are re-parented once it is gone).
    kill_with_parent: also ask the kernel for SIGKILL when the parent's thread that started us
    exits (PR_SET_PDEATHSIG), which reaches us even when the parent was SIGKILLed and no thread
    of ours gets to run.
    """
    if kill_with_parent:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    def watch() -> None:
        if lifeline is not None:
            try:
                lifeline.recv_bytes()
            except (EOFError, OSError):
                pass
        else:
            _wait_for_parent(parent_pid, interval_s)
        reason = f"parent process {parent_pid} exited"
        if on_exit is None:
            logger.info("%s; exiting", reason)
            os._exit(1)
        on_exit(reason)
        time.sleep(grace_s)
        os._exit(1)  # it did not stop in time; nobody is listening anyway

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_child_process(
    name: str, parent_pid: int | None, on_parent_exit: Callable[[str], None] | None = None
) -> None:
    """Common start of a launched process: log format, process name, exit when the parent goes
    (watch_parent: on_parent_exit is its on_exit)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_process_name(name)
    if parent_pid is not None:
        watch_parent(parent_pid, on_exit=on_parent_exit)


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
