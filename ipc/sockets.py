"""The socket pair of every ZeroMQ link here: a server binds one ROUTER, each client connects one
DEALER and gets its replies back on it, routed by identity (docs/protocol.md, "Sockets and
identities"). Queues are unbounded on both sides: ZeroMQ would otherwise drop messages silently
for a slow reader. With the engine's shared secret (ENGINE_CORE_KEY) both speak CurveZMQ
(ipc/curve.py)."""

from __future__ import annotations

import logging

import zmq

from ipc.curve import ENV_KEY, HandshakeWatch, is_exposed, secure_client, secure_server


def _unbounded(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class RouterServer:
    """A ROUTER bound to address (.address: where it is bound, a `:*` port resolved). With
    auth_key a CURVE server admitting only holders of the secret; without one on an address
    others can reach, a warning on log naming the server (name) and what anyone could do
    (exposes), and who has to share the secret (peers)."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        auth_key: str | None,
        *,
        linger_ms: int,
        log: logging.Logger,
        name: str,
        exposes: str,
        peers: str,
    ) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        _unbounded(self.socket)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        # The authenticator needs a blocking-API context (over the same libzmq one).
        self._auth = (
            secure_server(zmq.Context.shadow(ctx.underlying), self.socket, auth_key)
            if auth_key
            else None
        )
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if auth_key is None and is_exposed(self.address):
            log.warning(
                "%s listens on %s without authentication: anyone who reaches it can %s. "
                "Set %s to a secret (%s) or listen on a loopback address",
                name,
                self.address,
                exposes,
                ENV_KEY,
                peers,
            )

    def stop_auth(self) -> None:
        """Stop the CURVE authenticator, if any (once the socket is closed)."""
        if self._auth is not None:
            self._auth.stop()


def connect_dealer(
    ctx: zmq.Context,
    address: str,
    auth_key: str | None,
    *,
    peer: str | None = None,
    disconnects: bool = False,
) -> tuple[zmq.Socket, HandshakeWatch | None]:
    """A DEALER connected to address (with auth_key, a CURVE client holding the secret), and,
    given peer (how messages name the server), a HandshakeWatch reporting a refused key (with
    disconnects, also a closed connection)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _unbounded(sock)
    if auth_key:
        secure_client(sock, auth_key)
    # Also without a key: a CURVE server refuses a plain client.
    watch = None if peer is None else HandshakeWatch(sock, disconnects, peer)
    sock.connect(address)
    return sock, watch
