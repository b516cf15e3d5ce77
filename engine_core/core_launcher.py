"""Start an engine core as a child process on a private ipc:// address."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from config.engine import EngineConfig
from ipc.process import spawn_module


class CoreProcess:
    """A child `python -m engine_core.core_proc` that exits when this process dies, serving
    config (resolved: the child does not resolve it again) on address (default: a private
    ipc:// socket) with extra_env added to our environment.

    own_process_group keeps terminal signals (Ctrl-C) away from it, for a supervisor that
    stops its children in its own order.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        own_process_group: bool = False,
        address: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="engine-core-")
        self.address = address or f"ipc://{self._dir}/core.sock"
        self.popen = spawn_module(
            "engine_core.core_proc",
            [
                "--listen",
                self.address,
                "--parent-pid",
                str(os.getpid()),
                "--config",
                config.encode(),
            ],
            extra_env=extra_env,
            own_session=own_process_group,
        )

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.popen.pid

    def exit_code(self) -> int | None:
        """The child's exit status, or None while it runs."""
        return self.popen.poll()

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM the child, SIGKILL it after timeout seconds, and remove its socket directory."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
