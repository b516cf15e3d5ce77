"""Where headless hosts' engine cores join the first host of a data-parallel group.

The first host's launcher binds a ROUTER at tcp://<data-parallel-address>:<data-parallel-rpc-port>
when some ranks run elsewhere. A headless launcher (`engine serve --headless`) starts its engine
cores, waits until they are ready, then connects a DEALER and registers their addresses; the
first host starts its tokenizer processes once every rank is known. Afterwards both sides watch
each other: the headless side sends a heartbeat every second and the first host answers it; a
headless host whose engine core dies says so (the first host then stops its whole tree and
exits non-zero); the first host tells headless hosts to stop when it stops. Messages are
msgspec structs, one frame each, tagged by type; no pickle crosses the socket. With the
engine's shared secret (ENGINE_CORE_KEY) the socket speaks CurveZMQ as every other link does
(ipc/curve.py): only holders of the secret can register ranks, and a headless host with another
key is told so instead of waiting for an answer.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import msgspec
import zmq

from ipc.curve import ENV_KEY, HandshakeWatch, is_exposed, secure_client, secure_server

logger = logging.getLogger(__name__)

RENDEZVOUS_VERSION = 1
HEARTBEAT_S = 1.0
# A peer silent for this long is taken for dead (a killed launcher says nothing).
PEER_TIMEOUT_S = 10.0


class Register(msgspec.Struct, tag=True, array_like=True):
    """A headless host's engine cores, ready: ranks start_rank.. at addresses (rank order)."""

    version: int
    start_rank: int
    addresses: list[str]


class Accepted(msgspec.Struct, tag=True, array_like=True):
    """The first host took the registration."""


class Refused(msgspec.Struct, tag=True, array_like=True):
    """The first host refused the registration (the message says why); the headless host exits."""

    message: str


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Either side: still here."""


class Failed(msgspec.Struct, tag=True, array_like=True):
    """A headless host lost a child (the message names it) and is stopping."""

    message: str


class Stop(msgspec.Struct, tag=True, array_like=True):
    """The first host is stopping; failed: it stops on an error, not on a signal."""

    failed: bool = False


Message = Register | Accepted | Refused | Heartbeat | Failed | Stop
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class RendezvousError(RuntimeError):
    """A peer failed, went silent or refused; the message says which and why."""


def local_address_towards(host: str) -> str:
    """This host's IP address on the route to host (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def tcp_address(host: str, port: int) -> str:
    """A ZeroMQ tcp:// address (IPv6 literals in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class FirstHost:
    """The first host's side: collects registrations of ranks first_remote..size-1, then
    watches the hosts that sent them."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        port: int,
        size: int,
        first_remote: int,
        auth_key: str | None = None,
    ) -> None:
        self.size = size
        self.first_remote = first_remote
        self.address = tcp_address(address, port)
        self.addresses: dict[int, str] = {}  # rank -> engine core address
        self._hosts: dict[bytes, tuple[range, float]] = {}  # identity -> (ranks, last heard)
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if ":" in address:
            self._socket.setsockopt(zmq.IPV6, 1)
        # The authenticator needs a blocking-API context (over the same libzmq one).
        self._auth = (
            secure_server(zmq.Context.shadow(ctx.underlying), self._socket, auth_key)
            if auth_key
            else None
        )
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            raise RendezvousError(
                f"cannot bind {self.address} (--data-parallel-address, "
                f"--data-parallel-rpc-port): {e}"
            ) from None
        if auth_key is None and is_exposed(self.address):
            logger.warning(
                "the data-parallel rendezvous listens on %s without authentication: anyone "
                "who reaches it can register engine cores that this server's requests then go "
                "to. Set %s to a secret on every host",
                self.address,
                ENV_KEY,
            )

    def missing(self) -> list[int]:
        """Ranks no headless host has registered yet."""
        return [r for r in range(self.first_remote, self.size) if r not in self.addresses]

    def poll(self, timeout_s: float) -> None:
        """Handle what arrived within timeout_s; RendezvousError when a registered host failed
        or went silent."""
        deadline = time.monotonic() + timeout_s
        while self._socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            identity, payload = self._socket.recv_multipart()
            try:
                msg = _DECODER.decode(payload)
            except msgspec.DecodeError:
                continue
            if isinstance(msg, Register):
                self._register(identity, msg)
            elif identity in self._hosts:
                ranks, _ = self._hosts[identity]
                self._hosts[identity] = (ranks, time.monotonic())
                if isinstance(msg, Failed):
                    raise RendezvousError(f"headless ranks {_span(ranks)}: {msg.message}")
                if isinstance(msg, Heartbeat):
                    self._send(identity, Heartbeat())
        now = time.monotonic()
        for ranks, heard in self._hosts.values():
            if now - heard > PEER_TIMEOUT_S:
                raise RendezvousError(
                    f"the host of headless ranks {_span(ranks)} sent nothing "
                    f"for {PEER_TIMEOUT_S:.0f} s"
                )

    def _register(self, identity: bytes, msg: Register) -> None:
        ranks = range(msg.start_rank, msg.start_rank + len(msg.addresses))
        problem = None
        if msg.version != RENDEZVOUS_VERSION:
            problem = f"rendezvous version {msg.version}, this host speaks {RENDEZVOUS_VERSION}"
        elif not ranks or ranks.start < self.first_remote or ranks.stop > self.size:
            problem = (
                f"ranks {_span(ranks)} are not among the ranks this host waits for "
                f"({_span(range(self.first_remote, self.size))})"
            )
        elif any(r in self.addresses for r in ranks):
            problem = f"ranks {_span(ranks)} overlap ranks already registered"
        if problem is not None:
            self._send(identity, Refused(problem))
            return
        for rank, address in zip(ranks, msg.addresses):
            self.addresses[rank] = address
        self._hosts[identity] = (ranks, time.monotonic())
        self._send(identity, Accepted())

    def stop(self, failed: bool) -> None:
        """Tell every registered host to stop, and close (once)."""
        if self._socket.closed:
            return
        for identity in self._hosts:
            self._send(identity, Stop(failed))
        self._socket.close(linger=1000)
        if self._auth is not None:
            self._auth.stop()

    def _send(self, identity: bytes, msg: Message) -> None:
        self._socket.send_multipart([identity, _ENCODER.encode(msg)])


class HeadlessHost:
    """A headless host's side: registers its ranks, then heartbeats until told to stop."""

    def __init__(
        self, ctx: zmq.Context, address: str, port: int, auth_key: str | None = None
    ) -> None:
        self.address = tcp_address(address, port)
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if ":" in address:
            self._socket.setsockopt(zmq.IPV6, 1)
        if auth_key:
            secure_client(self._socket, auth_key)
        # Also without a key: a CURVE server refuses a plain client.
        self._watch = HandshakeWatch(self._socket, peer=f"the first host at {self.address}")
        self._socket.connect(self.address)
        self._last_sent = self._last_heard = time.monotonic()

    def register(
        self, start_rank: int, addresses: list[str], timeout_s: float, check: Callable[[], None]
    ) -> None:
        """Register and wait for the answer (calling check() between polls; it may raise);
        RendezvousError when refused or unanswered within timeout_s."""
        self._send(Register(RENDEZVOUS_VERSION, start_rank, addresses))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._socket.poll(200):
                msg = _DECODER.decode(self._socket.recv())
                self._last_heard = time.monotonic()
                if isinstance(msg, Refused):
                    raise RendezvousError(f"{self.address} refused the registration: {msg.message}")
                if isinstance(msg, Accepted):
                    return
            refused = self._watch.failure()
            if refused is not None:
                raise RendezvousError(refused)
            check()
        raise RendezvousError(
            f"no answer from {self.address} within {timeout_s:.0f} s: is "
            "`engine serve` running there with these --data-parallel-* flags?"
        )

    def poll(self, timeout_s: float) -> Stop | None:
        """Heartbeat when due; the first host's Stop when it sent one; RendezvousError when it
        went silent."""
        now = time.monotonic()
        if now - self._last_sent >= HEARTBEAT_S:
            self._send(Heartbeat())
        if self._socket.poll(int(timeout_s * 1000)):
            msg = _DECODER.decode(self._socket.recv())
            self._last_heard = time.monotonic()
            if isinstance(msg, Stop):
                return msg
        if time.monotonic() - self._last_heard > PEER_TIMEOUT_S:
            raise RendezvousError(
                f"the first host at {self.address} sent nothing for {PEER_TIMEOUT_S:.0f} s"
            )
        return None

    def fail(self, message: str) -> None:
        """Tell the first host that this host is stopping on an error."""
        self._send(Failed(message))

    def close(self) -> None:
        """Close the socket (a pending Failed still goes out, within a second)."""
        self._watch.close()
        self._socket.close(linger=1000)

    def _send(self, msg: Message) -> None:
        self._last_sent = time.monotonic()
        self._socket.send(_ENCODER.encode(msg))


def _span(ranks: range) -> str:
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"
