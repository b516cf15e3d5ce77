"""A child process of `engine serve`, what every child is handed, and the launch's errors."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.frames import FrameDecoder


class LaunchError(RuntimeError):
    """A child failed to start or died; the message names it."""


class StartUpInterrupted(LaunchError):
    """A stop signal came during start-up: a clean stop, not a failure."""


@dataclass
class Child:
    """A supervised child process and where it says it is ready: the socket address where it
    answers HELLO (engine cores, tokenizer processes), or the file it writes (API servers)."""

    name: str
    popen: subprocess.Popen
    address: str
    hello: list[bytes]
    # Engine core: the protocol's FrameDecoders; tokenizer processes: msgspec's.
    decoders: Mapping[int, FrameDecoder | msgspec.msgpack.Decoder]
    ready: Any = None


@dataclass(frozen=True)
class ChildSettings:
    """What the launcher hands every tokenizer process and API server on its command line."""

    config: str  # the resolved EngineConfig, encoded (EngineConfig.encode())
    parent_pid: int  # the launcher's: a child exits when it is gone
    stop_file: str  # where the launcher writes its StopOrder before SIGTERM
    shutdown_timeout: float
    chat_template_file: str | None  # --chat-template's text, written to a file (it may be long)

    def argv(self) -> list[str]:
        """The flags every child takes alike; the chat template is left to the caller (an API
        server's comes with its other chat flags, ChatOptions.argv)."""
        return [
            "--config",
            self.config,
            "--parent-pid",
            str(self.parent_pid),
            "--stop-file",
            self.stop_file,
            "--shutdown-timeout",
            str(self.shutdown_timeout),
        ]
