"""The tokenizer process: API servers' requests in (text, token ids or chat), token ids to the
engine core, text deltas back.

One ROUTER socket serves every API server; the identity a request came from owns it, so its
deltas go back there without a lookup service. A client whose HELLO gave a pid on this host is
watched: when it exits, its requests are aborted at once. A client that asked for heartbeats
(one on another host) exchanges them, and its requests are aborted once it falls silent
(tokenizer_proc/heartbeat.py). With the engine's shared secret (ENGINE_CORE_KEY) the socket
speaks CurveZMQ (ipc/curve.py). A DPEngineCoreClient talks to the engine cores
(one, or a data-parallel group: each request to the least loaded). Protocol:
protocol/tokenizer.py and docs/protocol.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from config.engine import EngineConfig, decode_config
from config.errors import ConfigError
from engine_core.client import EngineDeadError, EngineRequestError
from engine_core.dp_client import DPEngineCoreClient, OutputItem
from engine_core.generation_config import cap_unset_max_tokens
from engine_core.log_options import apply_log_options
from engine_core.validation import check_completion_fits, validate_request
from ipc.channel import Channel
from ipc.curve import key_from_env
from ipc.handshake import READY, HandshakeServer
from ipc.process import (
    EXIT_REQUESTS_CUT,
    StopOrder,
    host_identity,
    start_child_process,
    wait_for_exit,
)
from ipc.sockets import RouterServer
from metrics.request_stats import RequestStatsRecorder
from protocol.engine_core import EngineCoreOutputs, EngineCoreRequest
from protocol.tokenizer import (
    TOKENIZER_PROTOCOL_VERSION,
    ApiOutputType,
    ApiRequestType,
    GenerateRequest,
    Heartbeat,
    RequestDelta,
    RequestError,
    TokenizerHello,
    TokenizerReady,
    api_request_decoders,
)
from tokenizer_proc.heartbeat import HEARTBEAT_INTERVAL_S, Link, keep_alive, silence_timeout
from tokenizer_proc.output_processor import child_sampling_params
from tokenizer_proc.prompt_inputs import truncate_prompt, with_bad_words_tokenized
from tokenizer_proc.streams import DeltaStreams
from tokenizer_proc.tokenizer import apply_chat_template

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("tokenizer_proc")

_WATCH_INTERVAL_S = 0.5


def process_name(index: int) -> str:
    """The tokenizer process's name in /proc/<pid>/comm (the kernel keeps at most 15 bytes)."""
    return f"engine-tok-{index}"


class TokenizerProc:
    """Serves API servers on a bound ROUTER socket, forwarding to the engine cores."""

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase,
        engine: DPEngineCoreClient,
        listen: str,
        chat_template: str | None = None,
        auth_key: str | None = None,
    ) -> None:
        assert engine.ready is not None
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # --chat-template: for requests that give none
        self.engine = engine
        self.ready = TokenizerReady(
            TOKENIZER_PROTOCOL_VERSION,
            index,
            engine.ready.model_name,
            engine.ready.max_model_len,
            engine.ready.vocab_size,
            engine.ready.num_blocks,
            engine.ready.block_size,
        )
        self.streams = DeltaStreams(
            tokenizer,
            RequestStatsRecorder(engine.ready.model_name, engine.ready.max_model_len),
        )
        self._handshake = HandshakeServer(
            TOKENIZER_PROTOCOL_VERSION,
            "the tokenizer process",
            ApiOutputType.ERROR,
            lambda message: RequestError("", message),
        )
        self._ctx = zmq.asyncio.Context()
        # With a shared secret only its holders pass the handshake, and the wire is encrypted.
        self._server = RouterServer(
            self._ctx,
            listen,
            auth_key,
            linger_ms=1000,
            log=logger,
            name=f"tokenizer {index}",
            exposes="submit requests",
            peers="every process of the server and its clients set the same",
        )
        self._router = self._server.socket
        self.address = self._server.address
        # API servers' messages, in arrival order, for _api_loop; the replies and deltas go
        # out through the same channel at once (ipc/channel.py: no future per message).
        self._inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._channel = Channel(self._router, self._on_api_frames)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = api_request_decoders()
        self._draining = False
        self._engine_dead: str | None = None
        self._host = host_identity()
        # Client identity -> the tasks watching it (its pid, its heartbeats).
        self._watched: dict[bytes, list[asyncio.Task[None]]] = {}
        self._links: dict[bytes, Link] = {}  # client identity -> its heartbeat link

    async def serve(
        self, stop: asyncio.Event, stop_order: Callable[[], StopOrder], engine_pids: list[int] = ()
    ) -> bool:
        """Serve until stop is set, then refuse new requests and drain until stop_order()'s
        deadline; requests still running then fail with its reason. True when some had to."""
        # Each step's outputs are forwarded as they arrive, with no task switch on the way.
        self.engine.set_output_sink(self._on_engine_item)
        tasks = [asyncio.create_task(self._api_loop())]
        tasks += [asyncio.create_task(self._watch_engine(pid)) for pid in engine_pids]
        logger.info("tokenizer %d serving on %s", self.ready.worker_index, self.address)
        await stop.wait()
        self._draining = True
        order = stop_order()
        while len(self.streams) and order.remaining():
            await asyncio.sleep(0.05)
        cut = len(self.streams)
        if cut:
            logger.warning(
                "%d requests still running at the drain deadline; failing them: %s",
                cut,
                order.reason,
            )
            self._fail_all(order.reason, 503, abort=True)
        tasks += [task for watches in self._watched.values() for task in watches]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._channel.close()
        self._router.close(linger=1000)
        self._server.stop_auth()
        self.engine.shutdown()
        return cut > 0

    # ---- API servers -> engine core ----

    def _on_api_frames(self, frames: list[bytes]) -> None:
        link = self._links.get(frames[0])
        if link is not None:
            link.heard = True  # on arrival: _api_loop may be busy tokenizing a long prompt
        self._inbox.put_nowait(frames)

    async def _api_loop(self) -> None:
        while True:
            frames = await self._inbox.get()
            try:
                await self._on_message(frames[0], frames[1:])
            except EngineDeadError as e:
                self._on_engine_dead(str(e))
            except Exception:  # a frame must never stop the process
                logger.exception("dropped a frame from API server %r", frames[0])

    async def _on_message(self, identity: bytes, body: list[bytes]) -> None:
        if len(body) != 2 or len(body[0]) != 1 or body[0][0] not in self._decoders:
            await self._error(
                identity,
                "",
                "malformed message: expected two frames [type byte 0-3, msgpack payload]",
            )
            return
        kind = ApiRequestType(body[0][0])
        try:
            msg = self._decoders[kind].decode(body[1])
        except Exception as e:  # DecodeError, ValidationError (bad SamplingParams too)
            request_id = _first_str(body[1]) if kind == ApiRequestType.GENERATE else ""
            await self._error(identity, request_id, f"malformed {kind.name} payload: {e}")
            return
        if kind == ApiRequestType.HELLO:
            answer, reply = self._handshake.answer(
                msg,
                self.ready
                if not msg.heartbeat_s
                else msgspec.structs.replace(self.ready, heartbeat_s=HEARTBEAT_INTERVAL_S),
            )
            if answer == READY and identity not in self._watched:
                self._watch_client(identity, msg)
            await self._send(identity, ApiOutputType(answer), reply)
        elif kind == ApiRequestType.GENERATE:
            await self._generate(identity, msg)
        elif kind == ApiRequestType.ABORT:
            child_ids = [c for r in msg.request_ids for c in self.streams.remove(r, identity)]
            if child_ids and self._engine_dead is None:
                await self.engine.abort_requests(child_ids)

    async def _generate(self, identity: bytes, req: GenerateRequest) -> None:
        request_id = req.request_id
        if self._engine_dead is not None:
            await self._error(identity, request_id, self._engine_dead, 503)
            return
        if self._draining:
            await self._error(identity, request_id, "the server is shutting down", 503)
            return
        if request_id in self.streams:
            await self._error(identity, request_id, f"request id {request_id!r} is already in use")
            return
        try:
            params = with_bad_words_tokenized(self.tokenizer, req.sampling_params)
            # In a thread: a long prompt must not stall the streams this loop forwards (new
            # requests still wait their turn: this loop takes them one at a time).
            prompt_ids = truncate_prompt(
                await asyncio.to_thread(self._prompt_token_ids, req),
                params.truncate_prompt_tokens,
                self.config.max_model_len,
            )
            request = EngineCoreRequest(
                request_id,
                prompt_ids,
                params,
                req.arrival_time or time.time(),
                req.priority,
                req.cache_salt,
                req.api_server_index,
            )
            validate_request(request, self.config)
            check_completion_fits(request, self.config)
            request = cap_unset_max_tokens(request, self.config)
            params = request.sampling_params
        except Exception as e:  # ValueError, a chat template's own errors, bad message shapes
            await self._error(identity, request_id, f"{e}")
            return
        rank = self.engine.pick_engine()  # the n completions share their engine (and prefix)
        child_ids = self.streams.add(
            request_id, identity, prompt_ids, params, request.arrival_time, rank
        )
        if req.return_prompt_token_ids:
            self.streams.return_prompt_token_ids(request_id, prompt_ids)
        for index, child_id in enumerate(child_ids):
            child = (
                request
                if len(child_ids) == 1
                else msgspec.structs.replace(
                    request,
                    request_id=child_id,
                    sampling_params=child_sampling_params(params, index),
                )
            )
            await self.engine.add_request(child, rank)

    def _prompt_token_ids(self, req: GenerateRequest) -> list[int]:
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(req, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt, prompt_token_ids and messages; got "
                f"{', '.join(given) or 'none'}"
            )
        if req.prompt is not None:
            return self.tokenizer(
                req.prompt, add_special_tokens=req.add_special_tokens is not False
            ).input_ids
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        return apply_chat_template(
            self.tokenizer,
            req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template or self.chat_template,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
            add_special_tokens=bool(req.add_special_tokens),
        )

    # ---- engine core -> API servers ----

    def _on_engine_item(self, rank: int, item: OutputItem) -> None:
        """The DP client's sink: a step's outputs, a refusal or the engine's death."""
        if isinstance(item, EngineDeadError):
            self._on_engine_dead(str(item))
        elif isinstance(item, EngineRequestError):
            self._on_refused(item)
        elif self._engine_dead is None:
            self._forward_step(rank, item)

    def _forward_step(self, rank: int, step: EngineCoreOutputs) -> None:
        deltas, to_abort = self.streams.process(step.outputs, step.timestamp, rank)
        if to_abort:
            self.engine.abort_requests_nowait(to_abort)
        if len(deltas) == 1:  # a single stream: no grouping
            owner, delta = deltas[0]
            self._send_now(owner, ApiOutputType.DELTAS, [delta])
            return
        per_owner: dict[bytes, list[RequestDelta]] = {}
        for owner, delta in deltas:
            per_owner.setdefault(owner, []).append(delta)
        for owner, batch in per_owner.items():
            self._send_now(owner, ApiOutputType.DELTAS, batch)

    def _on_refused(self, e: EngineRequestError) -> None:
        entry = self.streams.owner_of_child(e.request_id)
        if entry is None:
            return
        request_id, owner = entry
        others = [c for c in self.streams.remove(request_id) if c != e.request_id]
        if others:
            self.engine.abort_requests_nowait(others)
        self.engine.forget(others)
        self._error_now(owner, request_id, str(e))

    async def _watch_engine(self, pid: int) -> None:
        await wait_for_exit(pid, _WATCH_INTERVAL_S)
        self._on_engine_dead(f"the engine core process {pid} exited")

    def _watch_client(self, identity: bytes, hello: TokenizerHello) -> None:
        """Watch a client (an API server) that said HELLO: its pid when it runs on this host,
        its heartbeats when it asked for them; the first to fail drops it."""
        name = hello.client_name or "?"
        watches = []
        if hello.pid and hello.host and hello.host == self._host:
            watches.append(self._watch_exit(identity, name, hello.pid))
        if hello.heartbeat_s > 0:
            self._links[identity] = link = Link()
            watches.append(self._watch_silence(identity, name, link, hello.heartbeat_s))
        if watches:
            self._watched[identity] = [asyncio.create_task(w) for w in watches]

    async def _watch_exit(self, identity: bytes, name: str, pid: int) -> None:
        await wait_for_exit(pid, _WATCH_INTERVAL_S)
        await self._drop_client(identity, f"client {name} (pid {pid}) exited")

    async def _watch_silence(self, identity: bytes, name: str, link: Link, interval: float) -> None:
        silence = await keep_alive(
            link,
            lambda: self._send(identity, ApiOutputType.HEARTBEAT, Heartbeat()),
            lambda: self._channel.has_input() or not self._inbox.empty(),
            silence_timeout(interval),
        )
        why = f"client {name} fell silent ({silence:.1f} s without a message or heartbeat)"
        # Heard only by a client that still reads (it was frozen, or the network healed).
        await self._error(identity, "", why, 503)
        await self._drop_client(identity, why)

    async def _drop_client(self, identity: bytes, why: str) -> None:
        """Forget a dead client: stop its other watches, abort its requests."""
        for task in self._watched.pop(identity, ()):
            if task is not asyncio.current_task():
                task.cancel()
        self._links.pop(identity, None)
        request_ids = [r for r, owner in self.streams.live() if owner == identity]
        child_ids = [c for r in request_ids for c in self.streams.remove(r)]
        logger.warning("%s; aborting its %d requests", why, len(request_ids))
        if child_ids and self._engine_dead is None:
            await self.engine.abort_requests(child_ids)

    def _on_engine_dead(self, message: str) -> None:
        if self._engine_dead is None:
            logger.error("%s; failing every request", message)
            self._engine_dead = message
            self._fail_all(message, 503, abort=False)

    def _fail_all(self, message: str, status: int, abort: bool) -> None:
        child_ids = []
        for request_id, owner in self.streams.live():
            child_ids += self.streams.remove(request_id)
            self._error_now(owner, request_id, message, status)
        if abort and child_ids and self._engine_dead is None:
            self.engine.abort_requests_nowait(child_ids)

    async def _error(
        self, identity: bytes, request_id: str, message: str, status: int = 400
    ) -> None:
        self._error_now(identity, request_id, message, status)

    def _error_now(self, identity: bytes, request_id: str, message: str, status: int = 400) -> None:
        self._send_now(identity, ApiOutputType.ERROR, RequestError(request_id, message, status))

    async def _send(self, identity: bytes, kind: ApiOutputType, msg: Any) -> None:
        self._send_now(identity, kind, msg)

    def _send_now(self, identity: bytes, kind: ApiOutputType, msg: Any) -> None:
        link = self._links.get(identity)
        if link is not None:
            link.sent = True
        self._channel.send([identity, bytes([kind]), self._encoder.encode(msg)])


def _first_str(payload: bytes) -> str:
    """The first array item of a payload that did not decode as its type, when it is a str."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return ""
    return raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else ""


async def run_tokenizer_proc(
    index: int,
    listen: str,
    engine_addresses: list[str],
    config: EngineConfig,
    engine_pids: list[int] = (),
    drain_timeout: float = 10.0,
    chat_template: str | None = None,
    stop_file: str | None = None,
) -> int:
    """Load the tokenizer, connect to the engine cores (DP rank i at engine_addresses[i]),
    serve until SIGTERM/SIGINT; the exit code (EXIT_REQUESTS_CUT when requests were cut).
    stop_file: where the launcher writes its StopOrder before the signal (else drain for
    drain_timeout seconds)."""
    from tokenizer_proc.tokenizer import load_chat_template, load_tokenizer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    apply_log_options(config.observability)
    tokenizer = load_tokenizer(config.tokenizer_path)
    connect = asyncio.create_task(
        DPEngineCoreClient.create(engine_addresses, client_name=f"tokenizer-{index}")
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([connect, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not connect.done():  # stopped while the engine core was still loading
        connect.cancel()
        return 0
    stopping.cancel()
    engine = connect.result()
    if engine.ready.max_model_len != config.max_model_len:  # not the configuration we were given
        raise ConfigError(
            f"the engine core serves max_model_len {engine.ready.max_model_len}, "
            f"the launcher's configuration says {config.max_model_len}"
        )
    proc = TokenizerProc(
        index, config, tokenizer, engine, listen, load_chat_template(chat_template), key_from_env()
    )
    cut = await proc.serve(stop, lambda: StopOrder.read(stop_file, drain_timeout), engine_pids)
    return EXIT_REQUESTS_CUT if cut else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenizer_proc.tokenizer_proc`: how the launcher starts a tokenizer process."""
    parser = argparse.ArgumentParser(prog="python -m tokenizer_proc.tokenizer_proc")
    parser.add_argument("--index", type=int, default=0, help="this worker's index")
    parser.add_argument("--listen", required=True, help="ZeroMQ address to bind for API servers")
    parser.add_argument(
        "--engine-address",
        required=True,
        action="append",
        help="an engine core's address; once per DP rank, in rank order",
    )
    parser.add_argument(
        "--config", required=True, help="the resolved configuration (EngineConfig.encode())"
    )
    parser.add_argument(
        "--engine-pid",
        type=int,
        action="append",
        default=[],
        help="fail requests when this (engine core) process exits; repeatable",
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    parser.add_argument(
        "--chat-template", help="the chat template (a file, or inline) for requests that give none"
    )
    parser.add_argument(
        "--stop-file",
        help="where the launcher writes why and until when to drain, before it sends SIGTERM",
    )
    args = parser.parse_args(argv)
    start_child_process(process_name(args.index), args.parent_pid)
    import uvloop  # a lighter loop than asyncio's own: the per-token path runs through it

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(
            run_tokenizer_proc(
                args.index,
                args.listen,
                args.engine_address,
                decode_config(args.config),
                args.engine_pid,
                args.shutdown_timeout,
                args.chat_template,
                args.stop_file,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
