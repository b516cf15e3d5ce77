"""Process naming and liveness, shared by the engine's processes."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

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
