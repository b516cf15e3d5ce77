"""Authentication and encryption of the engine's sockets: CurveZMQ keys from one secret.

Whoever knows the secret (ENGINE_CORE_KEY) may talk to the engine core; nobody else gets past
the handshake, and everything on the wire is encrypted. Both sides derive the same two Curve25519
key pairs from it, so no key files are handed around and any language's ZeroMQ binding can join:
a secret key is SHA-256(label + secret) in Z85, the public key libzmq's zmq_curve_public of it,
with the labels b"engine-core/server\\0" and b"engine-core/client\\0" (docs/protocol.md).
The engine core's ZAP handler admits exactly the derived client key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import socket as socketlib
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
import zmq.auth.thread
import zmq.utils.monitor
import zmq.utils.z85

ENV_KEY = "ENGINE_CORE_KEY"
_SERVER_LABEL = b"engine-core/server\0"
_CLIENT_LABEL = b"engine-core/client\0"
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_monitor_ids = itertools.count()


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded key pairs of the engine core (server) and its clients."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def key_from_env() -> str | None:
    """The shared secret from ENGINE_CORE_KEY, or None when unset or empty."""
    return os.environ.get(ENV_KEY) or None


def _pair(label: bytes, secret: str) -> tuple[bytes, bytes]:
    secret_key = zmq.utils.z85.encode(hashlib.sha256(label + secret.encode()).digest())
    return zmq.curve_public(secret_key), secret_key


def derive_keys(secret: str) -> CurveKeys:
    """The key pairs every holder of the secret derives alike."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; ENGINE_CORE_KEY needs it")
    server_public, server_secret = _pair(_SERVER_LABEL, secret)
    client_public, client_secret = _pair(_CLIENT_LABEL, secret)
    return CurveKeys(server_public, server_secret, client_public, client_secret)


class _OnlyOurClient:
    """ZAP credentials check: the one client public key derived from the secret."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) == self._client_public or key == self._client_public


def secure_server(
    ctx: zmq.Context, sock: zmq.Socket, secret: str
) -> zmq.auth.thread.ThreadAuthenticator:
    """Make sock (before bind) a CURVE server that admits only holders of the secret; stop()
    the returned authenticator when the socket closes."""
    keys = derive_keys(secret)
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(
        domain="*", credentials_provider=_OnlyOurClient(keys.client_public)
    )
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    return auth


def secure_client(sock: zmq.Socket, secret: str) -> None:
    """Make sock (before connect) a CURVE client holding the secret's client keys."""
    keys = derive_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class HandshakeWatch:
    """Reports a refused CURVE handshake (wrong or missing key) on a client socket, which ZeroMQ
    otherwise only shows as a server that never answers; with disconnects, also notes (in
    .disconnected, updated by failure()) that an established connection closed."""

    def __init__(
        self, sock: zmq.Socket, disconnects: bool = False, peer: str = "the engine core"
    ) -> None:
        address = f"inproc://engine-core-handshake-{os.getpid()}-{next(_monitor_ids)}"
        # One monitor per socket: the disconnect watch shares this one.
        sock.monitor(address, _FAILED | (zmq.EVENT_DISCONNECTED if disconnects else 0))
        self.disconnected = False
        self._peer = peer  # the server, as the reason names it
        # A plain (blocking-API) context over the same libzmq context: inproc reaches it.
        self._ctx = zmq.Context.shadow(sock.context.underlying)
        self._monitor = self._ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)

    @property
    def monitor(self) -> zmq.Socket:
        """The socket its events arrive on, for a loop to watch (ipc/channel.py) and hand each
        to event()."""
        return self._monitor

    def failure(self) -> str | None:
        """Why the last handshake failed, if one did since the last call."""
        reason = None
        while self._monitor.poll(0):
            reason = self.event(self._monitor.recv_multipart()) or reason
        return reason

    def event(self, frames: list[bytes]) -> str | None:
        """Take in one monitor message: why the handshake failed, if it says so (a closed
        connection only sets .disconnected)."""
        event = zmq.utils.monitor.parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.disconnected = True
            return None
        reason = (
            f"{self._peer} refused this client's key"
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            else "the CURVE handshake failed"
        )
        return reason + (
            f"; {self._peer} and its clients must share one secret in {ENV_KEY} (or neither set it)"
        )

    def close(self) -> None:
        self._monitor.close(linger=0)


def is_exposed(address: str) -> bool:
    """True for a tcp:// address that others can reach (not loopback)."""
    if not address.startswith("tcp://"):
        return False
    host = urlsplit(address).hostname or ""
    if host in ("*", ""):
        return True
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or an interface name
        try:
            return not ipaddress.ip_address(socketlib.gethostbyname(host)).is_loopback
        except OSError:
            return True
