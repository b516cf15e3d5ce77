"""Clients of an engine core process (docs/protocol.md): blocking and asyncio.

Each connects a DEALER socket to the engine core's ROUTER, either at a given address or to a
child engine core it starts itself, and completes the HELLO/READY handshake before returning.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from config.engine import EngineConfig
from engine_core.core_launcher import CoreProcess
from engine_core.resolve import resolved_config
from ipc.channel import Channel
from ipc.curve import HandshakeWatch, key_from_env
from ipc.handshake import ready_or_refused
from ipc.process import wait_for_exit
from ipc.sockets import connect_dealer
from protocol.engine_core import (
    PROTOCOL_VERSION,
    ClientHello,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    OutputType,
    RequestError,
    RequestType,
    UtilityOutput,
    UtilityRequest,
    output_decoders,
)
from protocol.frames import INLINE_MAX_BYTES, FrameEncoder

# How often a client waiting for messages checks that its child engine core still runs.
_LIVENESS_POLL_S = 0.2
_INT32 = np.iinfo(np.int32)


class EngineDeadError(RuntimeError):
    """The engine core reported a fatal error or its process exited."""


class EngineRequestError(ValueError):
    """The engine core refused a request (request_id is "" when it could not name one)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}" if request_id else message)
        self.request_id = request_id


class UtilityCallError(RuntimeError):
    """A utility call failed inside the engine core."""


class _ClientBase:
    """What both clients share: the child process, the codec and the liveness check."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str | None,
        engine_args: EngineConfig | dict[str, Any] | None,
        auth_key: str | None = None,
        fail_on_disconnect: bool = False,
    ) -> None:
        auth_key = auth_key or key_from_env()
        self.process = None
        if address is None:  # the child gets the configuration resolved here
            config = (
                engine_args
                if isinstance(engine_args, EngineConfig)
                else resolved_config(**(engine_args or {}))
            )
            self.process = CoreProcess(config)
        self.address = self.process.address if self.process is not None else address
        self.ready: EngineCoreReady | None = None
        self._ctx = ctx
        # Given an address, a refused key shows up here, not as a silent server.
        self._socket, self._handshake = connect_dealer(
            ctx,
            self.address,
            auth_key,
            peer="the engine core" if address is not None else None,
            disconnects=fail_on_disconnect,
        )
        self._encoder = FrameEncoder()
        self._decoders = output_decoders()
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._finalizer = weakref.finalize(
            self, _close, self._socket, ctx, self.process, self._handshake
        )

    def shutdown(self) -> None:
        """Close the socket and stop the child engine core, if this client started one."""
        self._finalizer()

    def _frames(self, kind: RequestType, msg: Any) -> list[bytes | memoryview]:
        return [bytes([kind]), *self._encoder.encode(msg)]

    def _decode(self, frames: list[zmq.Frame]) -> tuple[OutputType, Any]:
        kind = OutputType(frames[0].bytes[0])
        # Arrays in the outputs are views of their frames (recv_multipart(copy=False)).
        msg = self._decoders[kind].decode(frames[1].buffer, [f.buffer for f in frames[2:]])
        if kind == OutputType.DEAD:
            self._dead = f"the engine core died: {msg.message}"
            raise EngineDeadError(self._dead)
        return kind, msg

    def _judge_handshake(self, refused: str | None) -> None:
        """Mark the engine core dead when its handshake was refused, or (after READY) its
        connection closed."""
        assert self._handshake is not None
        if refused is not None:
            self._dead = f"cannot talk to the engine core at {self.address}: {refused}"
        elif self._handshake.disconnected and self.ready is not None:
            self._dead = f"the engine core at {self.address} closed the connection"

    def _check_alive(self) -> None:
        if self._dead is None and self._handshake is not None:
            self._judge_handshake(self._handshake.failure())
        if self._dead is None and self.process is not None:
            code = self.process.exit_code()
            if code is not None:
                self._dead = f"the engine core process exited with code {code}" + (
                    "" if self.ready else " during start-up (its log is above)"
                )
        if self._dead is not None:
            raise EngineDeadError(self._dead)


def _close(
    socket: zmq.Socket,
    ctx: zmq.Context,
    process: CoreProcess | None,
    handshake: HandshakeWatch | None,
) -> None:
    if handshake is not None:
        handshake.close()
    socket.close(linger=0)
    ctx.term()
    if process is not None:
        process.terminate()


def _with_prompt_array(request: EngineCoreRequest) -> EngineCoreRequest:
    """request with a long prompt as an int32 array, which travels as a frame, not a list."""
    ids = request.prompt_token_ids
    if not isinstance(ids, list) or len(ids) * 4 < INLINE_MAX_BYTES:
        return request
    # Anything but int32-sized ints goes as the list, and the engine core says what is wrong.
    try:
        array = np.asarray(ids)
    except ValueError:  # ragged nesting
        return request
    if (
        array.dtype != np.int64
        or array.ndim != 1
        or array.min() < _INT32.min
        or array.max() > _INT32.max
    ):
        return request
    return msgspec.structs.replace(request, prompt_token_ids=array.astype(np.int32))


def _handshake_answer(kind: OutputType, msg: Any) -> EngineCoreReady:
    """READY's payload; ConnectionError for any other answer to HELLO (a refusal)."""
    return ready_or_refused(kind, msg, "the engine core refused the connection")


class EngineCoreClient(_ClientBase):
    """Blocking client: connects to address, or starts a child engine core given engine_args
    (a resolved EngineConfig, or keyword arguments to resolve)."""

    def __init__(
        self,
        address: str | None = None,
        engine_args: EngineConfig | dict[str, Any] | None = None,
        *,
        startup_timeout: float = 300.0,
        client_name: str = "",
        auth_key: str | None = None,
    ) -> None:
        super().__init__(zmq.Context(), address, engine_args, auth_key)
        self._outputs: collections.deque[EngineCoreOutputs | RequestError] = collections.deque()
        self._results: dict[int, UtilityOutput] = {}
        try:
            self._send(RequestType.HELLO, ClientHello(PROTOCOL_VERSION, client_name))
            deadline = time.monotonic() + startup_timeout
            while self.ready is None:
                if not self._pump(deadline):
                    raise TimeoutError(
                        f"the engine core at {self.address} did not answer "
                        f"within {startup_timeout} s"
                    )
                if self._outputs:
                    _handshake_answer(OutputType.ERROR, self._outputs[0])
        except BaseException:
            self.shutdown()
            raise

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request; its outputs (or an EngineRequestError) come from get_output()."""
        self._send(RequestType.ADD, _with_prompt_array(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests of this client; each ends with an ABORT output."""
        self._send(RequestType.ABORT, request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next step's outputs for this client; EngineRequestError for a refused request."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outputs:
            if not self._pump(deadline):
                raise TimeoutError(f"no output within {timeout} s")
        item = self._outputs.popleft()
        if isinstance(item, RequestError):
            raise EngineRequestError(item.request_id, item.message)
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run a utility method in the engine core between steps and return its result."""
        call_id = next(self._call_ids)
        self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while call_id not in self._results:
            if not self._pump(deadline):
                raise TimeoutError(f"utility call {method!r} got no answer within {timeout} s")
        out = self._results.pop(call_id)
        if out.error is not None:
            raise UtilityCallError(f"{method}: {out.error}")
        return out.result

    def _send(self, kind: RequestType, msg: Any) -> None:
        self._check_alive()
        self._socket.send_multipart(self._frames(kind, msg), copy=False)

    def _pump(self, deadline: float | None) -> bool:
        """Receive and file one message; False when none came before deadline (monotonic)."""
        while True:
            wait = (
                _LIVENESS_POLL_S
                if deadline is None
                else min(_LIVENESS_POLL_S, deadline - time.monotonic())
            )
            if self._socket.poll(max(0, int(wait * 1000))):
                kind, msg = self._decode(self._socket.recv_multipart(copy=False))
                if kind == OutputType.READY:
                    self.ready = msg
                elif kind == OutputType.UTILITY:
                    self._results[msg.call_id] = msg
                else:
                    self._outputs.append(msg)
                return True
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return False


class AsyncEngineCoreClient(_ClientBase):
    """asyncio client; build it with `await AsyncEngineCoreClient.create(...)`."""

    def __init__(
        self,
        address: str | None = None,
        engine_args: EngineConfig | dict[str, Any] | None = None,
        auth_key: str | None = None,
        fail_on_disconnect: bool = False,
    ) -> None:
        super().__init__(zmq.asyncio.Context(), address, engine_args, auth_key, fail_on_disconnect)
        self._outputs: asyncio.Queue[EngineCoreOutputs | RequestError | BaseException] = (
            asyncio.Queue()
        )
        # Where outputs, refusals and the failure go: the queue get_output() reads, or the
        # callback a consumer installed with set_output_sink().
        self._sink: Callable[[EngineCoreOutputs | RequestError | BaseException], None] = (
            self._outputs.put_nowait
        )
        self._calls: dict[int, asyncio.Future[UtilityOutput]] = {}
        self._ready: asyncio.Future[EngineCoreReady] = asyncio.get_running_loop().create_future()
        self._failure: BaseException | None = None
        # Messages go to _on_message as they arrive, without a future each (ipc/channel.py).
        self._channel = Channel(self._socket, self._on_message, self._fail, copy=False)
        # Liveness without a timer, so an idle client never wakes: the handshake monitor's
        # events as they arrive, and the exit of an engine core this client started (pidfd).
        self._monitor = (
            None
            if self._handshake is None
            else Channel(self._handshake.monitor, self._on_monitor_event, self._fail)
        )
        self._watcher = asyncio.create_task(self._watch())

    @classmethod
    async def create(
        cls,
        address: str | None = None,
        engine_args: EngineConfig | dict[str, Any] | None = None,
        *,
        startup_timeout: float = 300.0,
        client_name: str = "",
        auth_key: str | None = None,
        fail_on_disconnect: bool = False,
    ) -> AsyncEngineCoreClient:
        """Connect (or start a child engine core) and wait for its READY. auth_key (default:
        $ENGINE_CORE_KEY) is the engine core's shared secret, when it has one.
        fail_on_disconnect: an engine core at address that closes the connection after READY
        counts as dead (EngineDeadError), where a plain client would wait for it to return."""
        client = cls(address, engine_args, auth_key, fail_on_disconnect)
        try:
            await client._send(RequestType.HELLO, ClientHello(PROTOCOL_VERSION, client_name))
            try:
                client.ready = await asyncio.wait_for(client._ready, startup_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"the engine core at {client.address} did not answer within {startup_timeout} s"
                ) from None
        except BaseException:
            client.shutdown()
            raise
        return client

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request; its outputs (or an EngineRequestError) come from get_output()."""
        await self._send(RequestType.ADD, _with_prompt_array(request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests of this client; each ends with an ABORT output."""
        await self._send(RequestType.ABORT, request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """abort_requests() from synchronous code (the send never waits)."""
        self._send_nowait(RequestType.ABORT, request_ids)

    def set_output_sink(
        self, sink: Callable[[EngineCoreOutputs | RequestError | BaseException], None]
    ) -> None:
        """Hand every later step's outputs, refusal (a RequestError) and the client's failure
        (once) to sink as they arrive, in the loop's thread, instead of queueing them for
        get_output(); what is queued already goes first."""
        while not self._outputs.empty():
            sink(self._outputs.get_nowait())
        self._sink = sink

    async def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs for this client; EngineRequestError for a refused request."""
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees the failure too
            raise item
        if isinstance(item, RequestError):
            raise EngineRequestError(item.request_id, item.message)
        return item

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method in the engine core between steps and return its result."""
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        await self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        out = await future
        if out.error is not None:
            raise UtilityCallError(f"{method}: {out.error}")
        return out.result

    def shutdown(self) -> None:
        """Stop reading, close the socket and stop the child engine core, if any."""
        self._watcher.cancel()
        self._channel.close()
        if self._monitor is not None:
            self._monitor.close()
        super().shutdown()

    async def _send(self, kind: RequestType, msg: Any) -> None:
        self._send_nowait(kind, msg)

    def _send_nowait(self, kind: RequestType, msg: Any) -> None:
        if self._failure is not None:
            raise self._failure
        self._check_alive()
        self._channel.send(self._frames(kind, msg), copy=False)

    async def _watch(self) -> None:
        """Fail once the engine core this client started exits."""
        if self.process is None:
            return
        try:
            await wait_for_exit(self.process.pid)
            self._check_alive()
        except Exception as e:
            self._fail(e)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        assert self._handshake is not None
        if self._dead is None:
            self._judge_handshake(self._handshake.event(frames))
        if self._dead is not None:
            raise EngineDeadError(self._dead)  # to _fail, through the channel

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        kind, msg = self._decode(frames)
        if kind == OutputType.READY:
            self._ready.set_result(msg)
        elif kind == OutputType.UTILITY:
            call = self._calls.pop(msg.call_id, None)
            if call is not None and not call.done():
                call.set_result(msg)
        elif kind == OutputType.ERROR and not self._ready.done():
            try:
                _handshake_answer(kind, msg)
            except ConnectionError as refused:
                self._ready.set_exception(refused)
        else:
            self._sink(msg)

    def _fail(self, error: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = error
        self._channel.close()
        if self._monitor is not None:
            self._monitor.close()
        self._watcher.cancel()
        waiters = [self._ready, *self._calls.values()]
        self._calls.clear()
        for future in waiters:
            if not future.done():
                future.set_exception(error)
        self._sink(error)
