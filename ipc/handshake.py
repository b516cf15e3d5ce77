"""The HELLO/READY handshake of every ZeroMQ protocol here (docs/protocol.md, "The handshake").

A client's first message is HELLO (type byte 0), whose payload starts with the client's protocol
version and name; the server answers READY (type byte 0) when the versions are equal, else a
refusal: the protocol's own error message, naming both versions. Each protocol keeps its
message types (protocol/engine_core.py, protocol/tokenizer.py); this module does the check,
the framing of a HELLO and the reading of the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

HELLO = 0  # the type byte of a client's HELLO, in every protocol
READY = 0  # the type byte of the server's READY, in every protocol


class Hello(Protocol):
    """What every protocol's HELLO carries first."""

    protocol_version: int
    client_name: str


def hello_frames(hello: msgspec.Struct) -> list[bytes]:
    """The frames of a HELLO: [type byte, msgpack payload]."""
    return [bytes([HELLO]), msgspec.msgpack.encode(hello)]


@dataclass(frozen=True)
class HandshakeServer:
    """A server's side of the handshake: version is the protocol it speaks, server how a refusal
    names it ("the engine core"), refusal the protocol's message for one (request id ""), sent
    with the type byte error_type."""

    version: int
    server: str
    error_type: int
    refusal: Callable[[str], Any]

    def answer(self, hello: Hello, ready: Any) -> tuple[int, Any]:
        """(type byte, payload) of the answer to hello: (READY, ready), or the refusal."""
        if hello.protocol_version != self.version:
            return self.error_type, self.refusal(
                f"protocol version mismatch: {self.server} speaks version {self.version}, the "
                f"client {hello.protocol_version}"
            )
        return READY, ready


def ready_or_refused(kind: int, msg: Any, refused: str) -> Any:
    """A client's reading of the answer to its HELLO: READY's payload, else ConnectionError
    "<refused>: <the refusal's message>"."""
    if kind != READY:
        raise ConnectionError(f"{refused}: {msg.message}")
    return msg
