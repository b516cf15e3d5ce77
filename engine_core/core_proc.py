"""The engine core process: EngineCore's busy loop behind one ZeroMQ ROUTER socket.

Threads: the I/O thread owns the ROUTER (ZeroMQ sockets are single-threaded): it receives,
decodes and validates client frames, answers HELLO and refusals itself, queues the rest for the
busy loop, and sends what the output thread encoded. The busy loop (the caller of run()) drains
its queue, blocks only when there is no work, steps the engine and runs utility calls between
steps. The output thread encodes outside the busy loop, so encoding overlaps the next step.
Wire format and handshake: docs/protocol.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from config.engine import EngineConfig, decode_config
from engine_core.engine_core import EngineCore
from engine_core.stream_gate import StreamGate
from engine_core.utilities import engine_utilities
from ipc.curve import key_from_env
from ipc.handshake import READY, HandshakeServer
from ipc.process import set_process_name, set_thread_name, start_child_process
from ipc.sockets import RouterServer
from protocol.engine_core import (
    PROTOCOL_VERSION,
    ClientHello,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineDead,
    Logprobs,
    OutputType,
    RequestError,
    RequestType,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    request_decoders,
)
from protocol.frames import INLINE_MAX_BYTES, FrameDecoder, FrameEncoder, tolist

logger = logging.getLogger("engine_core.proc")

_STOP = object()
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_BROADCAST = b""  # ZeroMQ routing ids are never empty, so b"" can mean "every known client".


class EngineCoreProc:
    """Serves one EngineCore to any number of DEALER clients on a bound ROUTER socket."""

    def __init__(
        self,
        engine: EngineCore,
        address: str,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        auth_key: str | None = None,
    ) -> None:
        self.engine = engine
        self._on_stats = on_stats
        config = engine.config
        assert config.arch is not None
        self.ready = EngineCoreReady(
            PROTOCOL_VERSION,
            config.model.served_model_name or "",
            config.max_model_len,
            engine.num_blocks,
            config.cache.block_size,
            config.arch.vocab_size,
            list(config.arch.eos_token_ids),
        )
        self._handshake = HandshakeServer(
            PROTOCOL_VERSION,
            "the engine core",
            OutputType.ERROR,
            lambda message: RequestError("", message),
        )
        self._ctx = zmq.Context()
        # With a shared secret only its holders pass the handshake, and the wire is encrypted.
        self._server = RouterServer(
            self._ctx,
            address,
            auth_key,
            linger_ms=2000,
            log=logger,
            name="the engine core",
            exposes="submit requests, read stats and reset the cache",
            peers="its clients set the same",
        )
        self._router = self._server.socket
        self.address = self._server.address
        # The busy loop queues outputs and pokes the I/O thread with a byte on this inproc pair;
        # the I/O thread encodes and sends them (one thread hop a step, not two).
        wake = f"inproc://engine-core-out-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(wake)
        self._push = self._ctx.socket(zmq.PUSH)  # the busy loop's thread only
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(wake)
        self._inputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._owners: dict[str, bytes] = {}  # live request id -> client identity (busy loop only)
        # A data-parallel rank tells every client its load after each step, so that their load
        # balancers see requests other clients placed here (docs/protocol.md).
        self._publish_load = config.parallel.data_parallel_size > 1
        self._clients: set[bytes] = set()  # identities that said HELLO (busy loop only)
        self._utilities = engine_utilities(engine)
        # --stream-interval above 1: requests' outputs held until they carry that many tokens.
        interval = config.scheduler.stream_interval
        self._gate = StreamGate(interval) if interval > 1 else None

    def run(self) -> int:
        """Serve until shutdown() (exit code 0) or a fatal engine error (exit code 1)."""
        io = threading.Thread(target=self._io_loop, name="engine-core-io", daemon=True)
        io.start()
        logger.info("engine core serving on %s", self.address)
        code = 0
        try:
            self._busy_loop()
        except Exception as e:
            logger.exception("engine core failed; telling clients and exiting")
            self._outputs.put((_BROADCAST, OutputType.DEAD, EngineDead(f"{type(e).__name__}: {e}")))
            code = 1
        self._outputs.put(_STOP)  # the I/O thread sends what is queued before it, then stops
        self._push.send(b"")
        io.join(timeout=5)
        self._push.close()
        self._server.stop_auth()
        if not io.is_alive():  # term() would wait for its sockets
            self._ctx.term()
        self.engine.shutdown()
        return code

    def shutdown(self) -> None:
        """Ask the busy loop to stop after its current step; safe from a signal handler."""
        self._inputs.put(_STOP)  # SimpleQueue.put is reentrant

    # ---- busy loop ----

    def _busy_loop(self) -> None:
        while True:
            items = [] if self.engine.has_unfinished_requests() else [self._inputs.get()]
            items += _drain(self._inputs)
            for item in items:
                if item is _STOP:
                    return
                self._handle(*item)
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, identity: bytes, kind: RequestType, msg: Any) -> None:
        if kind == RequestType.HELLO:
            self._clients.add(identity)
        elif kind == RequestType.ADD:
            if msg.request_id in self._owners:
                self._send(
                    identity,
                    OutputType.ERROR,
                    RequestError(
                        msg.request_id, f"request id {msg.request_id!r} is already in use"
                    ),
                )
                return
            try:
                self.engine.add_request(msg)
            except ValueError as e:
                self._send(identity, OutputType.ERROR, RequestError(msg.request_id, str(e)))
                return
            self._owners[msg.request_id] = identity
        elif kind == RequestType.ABORT:
            # A client may abort only its own requests.
            self.engine.abort_requests([r for r in msg if self._owners.get(r) == identity])
        else:
            self._send(identity, OutputType.UTILITY, self._call_utility(msg))

    def _call_utility(self, call: UtilityRequest) -> UtilityOutput:
        fn = self._utilities.get(call.method)
        if fn is None:
            return UtilityOutput(
                call.call_id,
                error=f"unknown utility method {call.method!r}; "
                f"known: {', '.join(sorted(self._utilities))}",
            )
        try:
            return UtilityOutput(call.call_id, result=fn(*call.args))
        except Exception as e:
            return UtilityOutput(call.call_id, error=f"{type(e).__name__}: {e}")

    def _step(self) -> None:
        step = self.engine.step()
        if self._on_stats is not None and step.scheduler_stats is not None:
            self._on_stats(step.scheduler_stats)
        per_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in step.outputs:
            owner = (
                self._owners.pop(out.request_id, None)
                if out.finished
                else self._owners.get(out.request_id)
            )
            if owner is None:
                continue
            sent = out if self._gate is None else self._gate.admit(out)
            if sent is not None:
                per_client.setdefault(owner, []).append(sent)
        for identity, outs in per_client.items():
            self._outputs.put(
                (
                    identity,
                    OutputType.OUTPUTS,
                    EngineCoreOutputs(outs, step.scheduler_stats, step.timestamp),
                )
            )
        if self._publish_load and step.scheduler_stats is not None:
            load = EngineCoreOutputs([], step.scheduler_stats, step.timestamp)
            for identity in self._clients.difference(per_client):
                self._outputs.put((identity, OutputType.OUTPUTS, load))
        if per_client or self._publish_load:
            self._push.send(b"")  # one poke a step, however many clients

    def _send(self, identity: bytes, kind: OutputType, msg: Any) -> None:
        """Queue one message for the I/O thread to encode and send (busy loop's thread only)."""
        self._outputs.put((identity, kind, msg))
        self._push.send(b"")

    # ---- I/O thread: the only user of the ROUTER socket ----

    def _io_loop(self) -> None:
        set_thread_name()
        encoder = FrameEncoder()
        decoders = request_decoders()
        clients: set[bytes] = set()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._pull in ready:
                while self._pull.poll(0):  # the pokes; what they announce is in the queue
                    self._pull.recv()
                if not self._send_outputs(encoder, clients):
                    break
            if self._router in ready:
                # copy=False: array frames are decoded as views of the received frames.
                frames = self._router.recv_multipart(copy=False)
                try:
                    reply = self._receive(frames, decoders, clients)
                except Exception:  # a frame must never stop the I/O thread
                    logger.exception("dropped a frame from client %r", frames[0].bytes)
                    continue
                if reply is not None:
                    kind, msg = reply
                    self._router.send_multipart(
                        [frames[0], bytes([kind]), *encoder.encode(msg)], copy=False
                    )
        self._pull.close()
        self._router.close()

    def _send_outputs(self, encoder: FrameEncoder, clients: set[bytes]) -> bool:
        """Encode and send every queued output; False once the stop mark is reached."""
        for item in _drain(self._outputs):
            if item is _STOP:
                return False
            identity, kind, msg = item
            try:
                if kind == OutputType.OUTPUTS:
                    _large_logprobs_as_arrays(msg)
                frames = encoder.encode(msg)
            except Exception:  # e.g. a utility result msgpack cannot hold; keep serving
                logger.exception("could not encode a %s message; dropped it", kind.name)
                continue
            targets = clients if identity == _BROADCAST else (identity,)
            for target in targets:
                # copy=False: array frames go out of the arrays' own memory.
                self._router.send_multipart([target, bytes([kind]), *frames], copy=False)
        return True

    def _receive(
        self, frames: list[zmq.Frame], decoders: dict[int, FrameDecoder], clients: set[bytes]
    ) -> tuple[OutputType, Any] | None:
        """Decode and check one client message; returns the reply to send at once, if any."""
        identity, body = frames[0].bytes, frames[1:]
        if len(body) < 2 or len(body[0]) != 1 or body[0].bytes[0] not in decoders:
            logger.warning(
                "client %r sent a message that is not [type byte, payload, buffers]", identity
            )
            return OutputType.ERROR, RequestError(
                "",
                "malformed message: expected frames [type byte 0-3, msgpack payload, "
                "array buffers...]",
            )
        kind, payload = RequestType(body[0].bytes[0]), body[1].buffer
        try:
            msg = decoders[kind].decode(payload, [f.buffer for f in body[2:]])
        except Exception as e:  # DecodeError, ValidationError, RecursionError on deep nesting...
            logger.warning("client %r sent a malformed %s payload: %s", identity, kind.name, e)
            return _malformed_reply(kind, payload, f"malformed {kind.name} payload: {e}")
        if kind == RequestType.HELLO:
            assert isinstance(msg, ClientHello)
            answer, reply = self._handshake.answer(msg, self.ready)
            if answer == READY:
                clients.add(identity)
                self._inputs.put((identity, kind, msg))  # the busy loop publishes load to it
            return OutputType(answer), reply
        clients.add(identity)
        if kind == RequestType.ADD:
            assert isinstance(msg, EngineCoreRequest)
            # The scheduler and the workers take token ids as a list.
            msg.prompt_token_ids = tolist(msg.prompt_token_ids)
            try:
                # Validation and block hashing here, off the busy loop.
                msg = self.engine.make_request(msg)
            except ValueError as e:
                return OutputType.ERROR, RequestError(msg.request_id, str(e))
        self._inputs.put((identity, kind, msg))
        return None


def _malformed_reply(
    kind: RequestType, payload: memoryview, message: str
) -> tuple[OutputType, Any]:
    """An error for a payload that did not decode, naming its request or call when it can."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        raw = None
    first = raw[0] if isinstance(raw, list) and raw else None
    if kind == RequestType.UTILITY and isinstance(first, int) and not isinstance(first, bool):
        return OutputType.UTILITY, UtilityOutput(first, error=message)
    request_id = first if kind == RequestType.ADD and isinstance(first, str) else ""
    return OutputType.ERROR, RequestError(request_id, message)


def _large_logprobs_as_arrays(outputs: EngineCoreOutputs) -> None:
    """Turn the worker's large logprob lists into arrays, which travel as frames, not lists."""
    for out in outputs.outputs:
        if out.new_logprobs is not None:
            out.new_logprobs = _logprob_arrays(out.new_logprobs)
        if out.new_prompt_logprobs is not None:
            out.new_prompt_logprobs = _logprob_arrays(out.new_prompt_logprobs)


def _logprob_arrays(lp: Logprobs) -> Logprobs:
    # Every position of a request has the same number of candidates (the rows are rectangular).
    if not lp.token_ids or len(lp.token_ids) * len(lp.token_ids[0]) * 4 < INLINE_MAX_BYTES:
        return lp
    return Logprobs(
        np.array(lp.token_ids, np.int32),
        np.array(lp.logprobs, np.float32),
        np.array(lp.ranks, np.int32),
    )


def _drain(q: queue.SimpleQueue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def run_engine_core(
    address: str, config: EngineConfig | dict[str, Any], parent_pid: int | None = None
) -> int:
    """Load the model, serve on address until SIGTERM/SIGINT or parent death; the exit code.
    config: resolved by whoever started us, or vLLM-style keyword arguments to resolve here
    (an engine core started on its own)."""
    # First, so that no stop signal can take its default action (death by the signal) from
    # here on: the handler's C part writes the signal's number to the wakeup pipe, whichever
    # thread the kernel picked, even one a library started at import time, before the mask
    # below; the signal thread reads it and stops cleanly.
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    # A Python signal handler runs only in the main thread, and not while the busy loop waits
    # on its queue; so every thread but the signal thread (all start after this line and
    # inherit the mask) blocks the stop signals, and they land on the signal thread.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    from engine_core.resolve import resolved_config
    from metrics.engine_stats import EngineStatsRecorder

    proc: EngineCoreProc | None = None

    def stop(reason: str, exit_code: int) -> None:
        logger.info("%s; stopping", reason)
        if proc is None:  # still loading the model: nothing to drain
            os._exit(exit_code)
        proc.shutdown()

    def on_signal() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        sig = os.read(wakeup_read, 1)[0]
        stop(f"got {signal.Signals(sig).name}", 128 + sig)

    # When the parent goes: drain as on a signal, hard exit after 10 s (the current step did
    # not end in time; nobody is listening anyway).
    start_child_process("engine-core", parent_pid, on_parent_exit=lambda why: stop(why, 1))
    threading.Thread(target=on_signal, name="engine-core-signals", daemon=True).start()
    # Each start-up phase's time at INFO, as vLLM logs them (bench/startup.py collects them).
    logger.info("engine core: interpreter and imports in %.2f s", process_age())
    began = time.perf_counter()
    if isinstance(config, dict):
        config = resolved_config(**config)
    rank = config.parallel.data_parallel_rank
    if rank is not None:
        set_process_name(f"engine-core-{rank}")
    logger.info("engine core: configuration resolved in %.2f s", time.perf_counter() - began)
    began = time.perf_counter()
    engine = EngineCore(config)
    logger.info(
        "engine core: engine built in %.2f s (model, %d KV blocks, warm-up)",
        time.perf_counter() - began,
        engine.num_blocks,
    )
    spec = config.speculative
    recorder = EngineStatsRecorder(
        config.model.served_model_name or "",
        engine=rank or 0,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
    )
    recorder.record_cache_config(config.cache, engine.num_blocks)
    proc = EngineCoreProc(engine, address, on_stats=recorder.record, auth_key=key_from_env())
    logger.info("engine core: ready in %.2f s since the process began", process_age())
    try:
        return proc.run()
    finally:
        recorder.flush()  # what the last busy second held


def process_age() -> float:
    """Seconds since this process began (its start time in /proc, 10 ms steps); 0.0 where
    /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


def _on_stop_signal(signum: int, frame: object) -> None:
    """The Python half of the stop signals' handler: nothing, the wakeup pipe carries them."""


def main(argv: list[str] | None = None) -> int:
    """`python -m engine_core.core_proc`: how a client starts its child engine core."""
    parser = argparse.ArgumentParser(prog="python -m engine_core.core_proc")
    parser.add_argument("--listen", required=True, help="ZeroMQ address to bind, e.g. ipc:///tmp/x")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--config", help="the resolved configuration (EngineConfig.encode())")
    given.add_argument(
        "--engine-args", help="EngineConfig keyword arguments as JSON, resolved here"
    )
    parser.add_argument(
        "--parent-pid", type=int, help="exit when this process is no longer our parent"
    )
    args = parser.parse_args(argv)
    config = decode_config(args.config) if args.config else json.loads(args.engine_args)
    return run_engine_core(args.listen, config, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
