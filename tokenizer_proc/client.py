"""Clients of tokenizer processes, for API servers: asyncio (TokenizerClient) and blocking.

Each connects one DEALER socket per tokenizer process and pins every request to one of them by
hashing its id (pin_worker), so the process keeping a request's detokenizer state also gets its
aborts.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenizer_proc.protocol import (TOKENIZER_PROTOCOL_VERSION, AbortRequest, ApiOutputType,
                                     ApiRequestType, GenerateRequest, RequestDelta, RequestError,
                                     TokenizerHello, TokenizerReady, api_output_decoders)


def pin_worker(request_id: str, num_workers: int) -> int:
    """The index of the tokenizer process that serves request_id (stable across processes)."""
    return zlib.crc32(request_id.encode()) % num_workers


class TokenizerRequestError(RuntimeError):
    """A tokenizer process failed a request; status is HTTP-like (400 invalid, 503 unavailable)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.request_id = error.request_id
        self.status = error.status


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


def _frames(kind: ApiRequestType, msg: Any) -> list[bytes]:
    return [bytes([kind]), msgspec.msgpack.encode(msg)]


class TokenizerClient:
    """asyncio client of M tokenizer processes; build it with `await TokenizerClient.create(...)`."""

    def __init__(self, addresses: list[str], client_name: str = "") -> None:
        self.addresses = list(addresses)
        self.ready: list[TokenizerReady] = []
        self._ctx = zmq.asyncio.Context()
        self._sockets = [_dealer(self._ctx, a) for a in self.addresses]
        self._decoders = api_output_decoders()
        self._queues: dict[str, asyncio.Queue[RequestDelta | RequestError]] = {}
        self._hello = [asyncio.get_running_loop().create_future() for _ in self._sockets]
        self._readers = [asyncio.create_task(self._read_loop(i)) for i in range(len(self._sockets))]
        self._client_name = client_name

    @classmethod
    async def create(cls, addresses: list[str], *, client_name: str = "",
                     timeout: float = 60.0) -> TokenizerClient:
        """Connect to every tokenizer process and wait for each one's READY."""
        client = cls(addresses, client_name)
        try:
            for sock in client._sockets:
                await sock.send_multipart(_frames(ApiRequestType.HELLO, TokenizerHello(
                    TOKENIZER_PROTOCOL_VERSION, client_name)))
            client.ready = list(await asyncio.wait_for(asyncio.gather(*client._hello), timeout))
        except BaseException:
            client.shutdown()
            raise
        return client

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Send request and yield its deltas until all n completions finish.

        Raises TokenizerRequestError when the tokenizer process fails the request. Closing the
        generator early (`aclose()`, `contextlib.aclosing`, cancellation) aborts the request.
        """
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use by this client")
        queue = self._queues[request_id] = asyncio.Queue()
        finished = 0
        try:
            await self._socket(request_id).send_multipart(
                _frames(ApiRequestType.GENERATE, request))
            while finished < request.sampling_params.n:
                item = await queue.get()
                if isinstance(item, RequestError):
                    raise TokenizerRequestError(item)
                finished += item.finished
                yield item
        finally:
            del self._queues[request_id]
            if finished < request.sampling_params.n and not self._ctx.closed:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent)."""
        await self._socket(request_id).send_multipart(
            _frames(ApiRequestType.ABORT, AbortRequest([request_id])))

    def shutdown(self) -> None:
        """Stop reading and close the sockets."""
        for task in self._readers:
            task.cancel()
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

    def _socket(self, request_id: str) -> zmq.asyncio.Socket:
        return self._sockets[pin_worker(request_id, len(self._sockets))]

    async def _read_loop(self, index: int) -> None:
        sock = self._sockets[index]
        while True:
            kind, payload = await sock.recv_multipart()
            msg = self._decoders[kind[0]].decode(payload)
            if kind[0] == ApiOutputType.READY:
                self._hello[index].set_result(msg)
            elif kind[0] == ApiOutputType.DELTAS:
                for delta in msg:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif msg.request_id in self._queues:
                self._queues[msg.request_id].put_nowait(msg)
            elif not msg.request_id and not self._hello[index].done():
                self._hello[index].set_exception(ConnectionError(
                    f"tokenizer process at {self.addresses[index]} refused: {msg.message}"))


class BlockingTokenizerClient:
    """A blocking client for scripts and tests: one request at a time per generate() call."""

    def __init__(self, addresses: list[str], *, timeout: float = 60.0) -> None:
        self.addresses = list(addresses)
        self._ctx = zmq.Context()
        self._sockets = [_dealer(self._ctx, a) for a in self.addresses]
        self._decoders = api_output_decoders()
        # Messages of requests other than the one being read, kept for their own generate().
        self._pending: dict[str, list[RequestDelta | RequestError]] = {}
        self.ready: list[TokenizerReady] = []
        for sock in self._sockets:
            sock.send_multipart(_frames(ApiRequestType.HELLO,
                                        TokenizerHello(TOKENIZER_PROTOCOL_VERSION)))
        for sock, address in zip(self._sockets, self.addresses):
            if not sock.poll(int(timeout * 1000)):
                self.close()
                raise TimeoutError(f"tokenizer process at {address} did not answer in {timeout} s")
            kind, payload = sock.recv_multipart()
            msg = self._decoders[kind[0]].decode(payload)
            if not isinstance(msg, TokenizerReady):
                self.close()
                raise ConnectionError(f"tokenizer process at {address} refused: {msg.message}")
            self.ready.append(msg)

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
            _frames(ApiRequestType.ABORT, AbortRequest([request_id])))

    def close(self) -> None:
        """Close the sockets."""
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

    def _socket(self, request_id: str) -> zmq.Socket:
        return self._sockets[pin_worker(request_id, len(self._sockets))]

    def _receive(self, sock: zmq.Socket, request_id: str,
                 timeout: float) -> RequestDelta | RequestError:
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
