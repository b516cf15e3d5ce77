"""Clients of tokenizer processes, for API servers: asyncio (TokenizerClient) and blocking.

Each connects one DEALER socket per tokenizer process and pins every request to one of them by
hashing its id (pin_worker), so the process keeping a request's detokenizer state also gets its
aborts. The HELLO carries the client's pid, so a tokenizer process on the same host aborts the
requests of a client that died. The asyncio client watches each tokenizer process's pid when
it is given it, else exchanges heartbeats with it (tokenizer_proc/heartbeat.py): a tokenizer
process that falls silent fails its requests with 503, as one that exits does. With the
engine's shared secret (ENGINE_CORE_KEY) the sockets speak CurveZMQ (ipc/curve.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ipc.channel import Channel
from ipc.curve import key_from_env
from ipc.handshake import hello_frames, ready_or_refused
from ipc.process import host_identity, wait_for_exit
from ipc.sockets import connect_dealer
from protocol.tokenizer import (
    TOKENIZER_PROTOCOL_VERSION,
    AbortRequest,
    ApiOutputType,
    ApiRequestType,
    GenerateRequest,
    Heartbeat,
    RequestDelta,
    RequestError,
    TokenizerHello,
    TokenizerReady,
    api_output_decoders,
)
from tokenizer_proc.heartbeat import HEARTBEAT_INTERVAL_S, Link, keep_alive, silence_timeout

logger = logging.getLogger("tokenizer_proc.client")

# How often a client waiting for READY checks for a refused handshake.
_POLL_S = 0.1


def pin_worker(request_id: str, num_workers: int) -> int:
    """The index of the tokenizer process that serves request_id (stable across processes)."""
    return zlib.crc32(request_id.encode()) % num_workers


class TokenizerRequestError(RuntimeError):
    """A tokenizer process failed a request; status is HTTP-like (400 invalid, 503 unavailable)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.request_id = error.request_id
        self.status = error.status


class _Dealers:
    """One DEALER per tokenizer process (with a shared secret, CURVE clients), whose refused
    handshakes are reported (refusal()) instead of looking like a silent server."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], auth_key: str | None) -> None:
        self.sockets = []
        self.watches = []
        for address in addresses:
            sock, watch = connect_dealer(
                ctx, address, auth_key, peer=f"the tokenizer process at {address}"
            )
            self.sockets.append(sock)
            self.watches.append(watch)

    def refusal(self) -> str | None:
        """Why a tokenizer process refused this client's key, if one did."""
        return next(filter(None, (w.failure() for w in self.watches)), None)

    def close(self) -> None:
        for watch in self.watches:
            watch.close()
        for sock in self.sockets:
            sock.close(linger=0)


def _raise_if_refused(dealers: _Dealers) -> None:
    refused = dealers.refusal()
    if refused is not None:
        raise ConnectionError(refused)


def _frames(kind: ApiRequestType, msg: Any) -> list[bytes]:
    return [bytes([kind]), msgspec.msgpack.encode(msg)]


def _hello_frames(client_name: str = "", heartbeat_s: float = 0.0) -> list[bytes]:
    """A HELLO naming this process, so that the tokenizer process can watch it; heartbeat_s:
    ask to exchange heartbeats, this client sending one every heartbeat_s on a quiet link."""
    return hello_frames(
        TokenizerHello(
            TOKENIZER_PROTOCOL_VERSION, client_name, os.getpid(), host_identity(), heartbeat_s
        )
    )


def _refused(address: str) -> str:
    return f"tokenizer process at {address} refused"


class TokenizerClient:
    """asyncio client of M tokenizer processes; build it with
    `await TokenizerClient.create(...)`."""

    def __init__(
        self, addresses: list[str], client_name: str = "", auth_key: str | None = None
    ) -> None:
        self.addresses = list(addresses)
        self.ready: list[TokenizerReady] = []
        self._ctx = zmq.asyncio.Context()
        self._dealers = _Dealers(self._ctx, self.addresses, auth_key or key_from_env())
        self._sockets = self._dealers.sockets
        self._decoders = api_output_decoders()
        self._queues: dict[str, asyncio.Queue[RequestDelta | RequestError]] = {}
        self._hello = [asyncio.get_running_loop().create_future() for _ in self._sockets]
        # Each tokenizer process's messages go to _on_message as they arrive, and sends go out
        # at once (ipc/channel.py: no future per message).
        self._channels = [
            Channel(
                sock,
                functools.partial(self._on_message, i),
                functools.partial(self._on_channel_error, i),
            )
            for i, sock in enumerate(self._sockets)
        ]
        self._readers: list[asyncio.Task[None]] = []
        self._client_name = client_name
        # Why each tokenizer process cannot serve (it exited or fell silent), or why none can
        # (fail_all).
        self._dead: dict[int, str] = {}
        self._stopped: str | None = None
        # Tokenizer processes whose pid this client does not watch: it asks them for
        # heartbeats, and the links of those that agreed.
        self._ask_heartbeats = [True] * len(self._sockets)
        self._links: dict[int, Link] = {}
        self._beats: dict[int, asyncio.Task[None]] = {}

    @classmethod
    async def create(
        cls,
        addresses: list[str],
        *,
        client_name: str = "",
        timeout: float | None = 60.0,
        pids: list[int] | None = None,
        auth_key: str | None = None,
    ) -> TokenizerClient:
        """Connect to every tokenizer process and wait for each one's READY (timeout None: as
        long as it takes). pids: the tokenizer processes' pids (same host, in address order);
        when one exits, its requests fail with 503 at once (unavailable() says why). With a
        tokenizer process whose pid is not given (0, or no pids) it exchanges heartbeats, and
        fails its requests with 503 once it falls silent for heartbeat.silence_timeout (1 s).
        auth_key: the shared secret, default $ENGINE_CORE_KEY."""
        client = cls(addresses, client_name, auth_key)
        pids = list(pids or ())
        try:
            for i in range(len(client._sockets)):
                client._ask_heartbeats[i] = i >= len(pids) or not pids[i]
                client._channels[i].send(
                    _hello_frames(
                        client_name, HEARTBEAT_INTERVAL_S if client._ask_heartbeats[i] else 0.0
                    )
                )
            hello = asyncio.gather(*client._hello)
            deadline = float("inf") if timeout is None else time.monotonic() + timeout
            while not (await asyncio.wait([hello], timeout=_POLL_S))[0]:
                _raise_if_refused(client._dealers)
                if time.monotonic() > deadline:
                    hello.cancel()
                    raise TimeoutError(
                        f"tokenizer processes {client.addresses} did not answer in {timeout} s"
                    )
            client.ready = list(hello.result())
        except BaseException:
            client.shutdown()
            raise
        client._readers += [
            asyncio.create_task(client._watch(i, pid)) for i, pid in enumerate(pids) if pid
        ]
        return client

    def unavailable(self) -> str | None:
        """Why requests cannot be served (a tokenizer process exited, or fail_all), or None."""
        return self._stopped or next(iter(self._dead.values()), None)

    def live_requests(self) -> int:
        """How many requests are in flight."""
        return len(self._queues)

    def fail_all(self, message: str) -> int:
        """Fail every request in flight, and every later one, with 503 and message; returns how
        many were in flight."""
        self._stopped = message
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestError(request_id, message, 503))
        return len(self._queues)

    async def _watch(self, index: int, pid: int) -> None:
        await wait_for_exit(pid)
        self._fail_worker(index, f"the tokenizer process {pid} exited")

    async def _keep_alive(self, index: int, interval: float) -> None:
        silence = await keep_alive(
            self._links[index],
            lambda: self._send(index, _frames(ApiRequestType.HEARTBEAT, Heartbeat())),
            self._channels[index].has_input,
            silence_timeout(interval),
        )
        self._fail_worker(
            index,
            f"the tokenizer process at {self.addresses[index]} fell silent "
            f"({silence:.1f} s without a message or heartbeat)",
        )

    def _fail_worker(self, index: int, message: str) -> None:
        """Fail the requests of tokenizer process index, and every later one, with 503."""
        if index in self._dead:
            return
        logger.error("%s; failing its requests", message)
        self._dead[index] = message
        beats = self._beats.pop(index, None)
        if beats is not None and beats is not asyncio.current_task():
            beats.cancel()
        for request_id, queue in self._queues.items():
            if pin_worker(request_id, len(self._sockets)) == index:
                queue.put_nowait(RequestError(request_id, message, 503))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Send request and yield its deltas until all n completions finish.

        Raises TokenizerRequestError when the tokenizer process fails the request. Closing the
        generator early (`aclose()`, `contextlib.aclosing`, cancellation) aborts the request.
        """
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use by this client")
        down = self._stopped or self._dead.get(pin_worker(request_id, len(self._sockets)))
        if down is not None:
            raise TokenizerRequestError(RequestError(request_id, down, 503))
        queue = self._queues[request_id] = asyncio.Queue()
        finished = 0
        try:
            await self._send(
                pin_worker(request_id, len(self._sockets)),
                _frames(ApiRequestType.GENERATE, request),
            )
            while finished < request.sampling_params.n:
                item = await queue.get()
                if isinstance(item, RequestError):
                    raise TokenizerRequestError(item)
                finished += item.finished
                yield item
        finally:
            del self._queues[request_id]
            if (
                finished < request.sampling_params.n
                and not self._ctx.closed
                and pin_worker(request_id, len(self._sockets)) not in self._dead
            ):
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent)."""
        await self._send(
            pin_worker(request_id, len(self._sockets)),
            _frames(ApiRequestType.ABORT, AbortRequest([request_id])),
        )

    def shutdown(self) -> None:
        """Stop reading and close the sockets."""
        for task in [*self._readers, *self._beats.values()]:
            task.cancel()
        for channel in self._channels:
            channel.close()
        self._dealers.close()
        self._ctx.term()

    async def _send(self, index: int, frames: list[bytes]) -> None:
        link = self._links.get(index)
        if link is not None:
            link.sent = True
        self._channels[index].send(frames)

    def _on_channel_error(self, index: int, error: BaseException) -> None:
        self._fail_worker(
            index, f"lost the link to the tokenizer process at {self.addresses[index]}: {error}"
        )

    def _on_message(self, index: int, frames: list[bytes]) -> None:
        kind, payload = frames
        link = self._links.get(index)
        if link is not None:
            link.heard = True
        msg = self._decoders[kind[0]].decode(payload)
        if kind[0] == ApiOutputType.READY:
            self._hello[index].set_result(msg)
            # From its READY on, the tokenizer process expects our heartbeats (an older
            # one, heartbeat_s 0, neither sends nor expects any).
            if self._ask_heartbeats[index] and msg.heartbeat_s > 0:
                self._links[index] = Link()
                self._beats[index] = asyncio.create_task(self._keep_alive(index, msg.heartbeat_s))
        elif kind[0] == ApiOutputType.DELTAS:
            for delta in msg:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        elif kind[0] == ApiOutputType.HEARTBEAT:
            pass  # heard: that is all it says
        elif msg.request_id in self._queues:
            self._queues[msg.request_id].put_nowait(msg)
        elif not msg.request_id and not self._hello[index].done():
            try:
                ready_or_refused(kind[0], msg, _refused(self.addresses[index]))
            except ConnectionError as refused:
                self._hello[index].set_exception(refused)
        elif not msg.request_id and msg.status == 503:
            self._fail_worker(
                index,
                f"the tokenizer process at {self.addresses[index]} "
                f"dropped this client: {msg.message}",
            )


class BlockingTokenizerClient:
    """A blocking client for scripts and tests: one request at a time per generate() call."""

    def __init__(
        self, addresses: list[str], *, timeout: float = 60.0, auth_key: str | None = None
    ) -> None:
        self.addresses = list(addresses)
        self._ctx = zmq.Context()
        self._dealers = _Dealers(self._ctx, self.addresses, auth_key or key_from_env())
        self._sockets = self._dealers.sockets
        self._decoders = api_output_decoders()
        # Messages of requests other than the one being read, kept for their own generate().
        self._pending: dict[str, list[RequestDelta | RequestError]] = {}
        self.ready: list[TokenizerReady] = []
        deadline = time.monotonic() + timeout
        for sock, address in zip(self._sockets, self.addresses):
            self._send_hello(sock, address, deadline, timeout)
        for sock, address in zip(self._sockets, self.addresses):
            while not sock.poll(int(_POLL_S * 1000)):
                try:
                    _raise_if_refused(self._dealers)
                except ConnectionError:
                    self.close()
                    raise
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(
                        f"tokenizer process at {address} did not answer in {timeout} s"
                    )
            kind, payload = sock.recv_multipart()
            try:
                self.ready.append(
                    ready_or_refused(
                        kind[0], self._decoders[kind[0]].decode(payload), _refused(address)
                    )
                )
            except ConnectionError:
                self.close()
                raise

    def _send_hello(self, sock: zmq.Socket, address: str, deadline: float, timeout: float) -> None:
        """Send HELLO without blocking: a refused handshake may drop the connection's queue
        before the send (a loaded machine), and a blocking send would then wait forever."""
        while True:
            try:
                sock.send_multipart(_hello_frames(), zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            try:
                _raise_if_refused(self._dealers)
            except ConnectionError:
                self.close()
                raise
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"tokenizer process at {address} did not answer in {timeout} s")
            time.sleep(_POLL_S / 10)

    def send(self, request: GenerateRequest) -> None:
        """Send a request without waiting; read it with deltas(request_id, n)."""
        self._socket(request.request_id).send_multipart(_frames(ApiRequestType.GENERATE, request))

    def deltas(self, request_id: str, n: int = 1, timeout: float = 60.0) -> Iterator[RequestDelta]:
        """Yield a sent request's deltas until its n completions finish."""
        sock = self._socket(request_id)
        finished = 0
        while finished < n:
            backlog = self._pending.get(request_id)
            if backlog:
                item = backlog.pop(0)
            else:
                item = self._receive(sock, request_id, timeout)
            if isinstance(item, RequestError):
                self._pending.pop(request_id, None)
                raise TokenizerRequestError(item)
            finished += item.finished
            yield item
        self._pending.pop(request_id, None)

    def generate(self, request: GenerateRequest, timeout: float = 60.0) -> list[RequestDelta]:
        """Send a request and return all its deltas."""
        self.send(request)
        return list(self.deltas(request.request_id, request.sampling_params.n, timeout))

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent)."""
        self._socket(request_id).send_multipart(
            _frames(ApiRequestType.ABORT, AbortRequest([request_id]))
        )

    def close(self) -> None:
        """Close the sockets."""
        self._dealers.close()
        self._ctx.term()

    def _socket(self, request_id: str) -> zmq.Socket:
        return self._sockets[pin_worker(request_id, len(self._sockets))]

    def _receive(
        self, sock: zmq.Socket, request_id: str, timeout: float
    ) -> RequestDelta | RequestError:
        deadline = time.monotonic() + timeout
        while True:
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"no output for request {request_id!r} within {timeout} s")
            kind, payload = sock.recv_multipart()
            msg = self._decoders[kind[0]].decode(payload)
            items = msg if kind[0] == ApiOutputType.DELTAS else [msg]
            mine = None
            for item in items:
                if item.request_id == request_id and mine is None:
                    mine = item
                else:
                    self._pending.setdefault(item.request_id, []).append(item)
            if mine is not None:
                return mine
