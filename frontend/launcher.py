"""`engine serve`: start the engine cores and the tokenizer processes, supervise them, drain on
SIGTERM/SIGINT, and stop everything when any child dies.

Children are started in tiers (engine cores: one per local data-parallel rank, then tokenizer
processes, each connected to every rank, then the HTTP API servers) and stopped in the reverse
order. With ranks on other hosts, the first host waits for them to register before it starts
its tokenizer processes; `--headless` starts only engine cores and registers them with the
first host (frontend/dp_rendezvous.py). The engine core and tokenizer processes are ready
when they answer a HELLO on their socket with READY, an API server when it has written its
ready file; /health answers 200 only once the launcher has seen every child ready and written
the serving file. Every child watches the launcher's pid and exits when it is gone.

Stopping, the launcher first writes a StopOrder (why, and until when requests may drain: one
deadline for every tier) where the children read it on SIGTERM; a child that had to cut requests
exits EXIT_REQUESTS_CUT, and the launcher then exits 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from config.engine import EngineConfig
from config.errors import ConfigError
from engine_core.core_launcher import CoreProcess
from engine_core.resolve import resolved_config
from frontend import api_server
from frontend.chat_args import ChatOptions
from frontend.dp_rendezvous import (
    FirstHost,
    HeadlessHost,
    RendezvousError,
    local_address_towards,
    tcp_address,
)
from frontend.http_options import HttpOptions
from ipc.curve import key_from_env
from ipc.handshake import hello_frames, ready_or_refused
from ipc.process import EXIT_REQUESTS_CUT, StopOrder, spawn_module
from ipc.sockets import connect_dealer
from metrics.exposition import setup_multiprocess_dir
from protocol.engine_core import PROTOCOL_VERSION, ClientHello, output_decoders
from protocol.frames import FrameDecoder
from protocol.tokenizer import TOKENIZER_PROTOCOL_VERSION, TokenizerHello, api_output_decoders
from tokenizer_proc.tokenizer_proc import process_name

if TYPE_CHECKING:  # Ray is optional: imported only with --data-parallel-backend ray
    from frontend.ray_dp_launch import RayEngineCores

_POLL_S = 0.2
# How long a child may take to exit after SIGTERM once its drain deadline has passed.
_STOP_TIMEOUT_S = 10.0


class LaunchError(RuntimeError):
    """A child failed to start or died; the message names it."""


class StartUpInterrupted(LaunchError):
    """A stop signal came during start-up: a clean stop, not a failure."""


@dataclass(frozen=True)
class DataParallelPlan:
    """Which data-parallel ranks this host runs, from the --data-parallel-* flags."""

    size: int
    local: range
    headless: bool
    address: str
    rpc_port: int
    ray: bool = False  # every rank's engine core in a Ray actor (frontend/ray_dp_launch.py)

    @classmethod
    def from_args(cls, engine_args: dict[str, Any], headless: bool) -> DataParallelPlan:
        """The plan, or ValueError naming the flag that does not fit."""
        size = engine_args.get("data_parallel_size", 1)
        start = engine_args.get("data_parallel_start_rank", 0)
        count = engine_args.get("data_parallel_size_local")
        count = size - start if count is None else count
        if size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
        if engine_args.get("data_parallel_backend") == "ray":
            if headless or any(
                f"data_parallel_{name}" in engine_args
                for name in ("size_local", "start_rank", "address", "rpc_port")
            ):
                raise ValueError(
                    "--data-parallel-backend ray places every rank on the Ray "
                    "cluster: --headless and --data-parallel-size-local, "
                    "-start-rank, -address and -rpc-port are for the mp backend"
                )
            return cls(size, range(0), False, "", 0, ray=True)
        if not headless and start != 0:
            raise ValueError(
                "--data-parallel-start-rank is for --headless hosts: the first host "
                "runs ranks 0 to --data-parallel-size-local - 1"
            )
        if not 1 <= count <= size - start or start < 0:
            raise ValueError(
                f"--data-parallel-size-local {count} from --data-parallel-start-rank "
                f"{start} does not fit --data-parallel-size {size} (each host runs at "
                "least one rank)"
            )
        return cls(
            size,
            range(start, start + count),
            headless,
            engine_args.get("data_parallel_address", "127.0.0.1"),
            engine_args.get("data_parallel_rpc_port", 29550),
        )

    @property
    def remote(self) -> range:
        """The ranks other hosts run, as the first host sees them (empty when headless)."""
        return range(0) if self.headless else range(self.local.stop, self.size)


@dataclass
class Child:
    """A supervised child process and the socket address where it answers HELLO."""

    name: str
    popen: subprocess.Popen
    address: str
    hello: list[bytes]
    # Engine core: the protocol's FrameDecoders; tokenizer processes and API servers: msgspec's.
    decoders: dict[int, FrameDecoder | msgspec.msgpack.Decoder]
    ready: Any = None


class Launcher:
    """Starts, supervises and stops the processes of `engine serve`."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        tokenizer_workers: int = 1,
        tokenizer_listen: list[str] | None = None,
        shutdown_timeout: float = 10.0,
        api_server_count: int = 1,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        max_request_body: int = api_server.DEFAULT_MAX_REQUEST_BODY,
        chat: ChatOptions = ChatOptions(),
        disable_ui: bool = False,
        headless: bool = False,
        http: HttpOptions = HttpOptions(),
    ) -> None:
        self.dp = DataParallelPlan.from_args(engine_args, headless)
        self.http = http
        if headless:
            api_server_count = 0
        if api_server_count < 0:
            raise ValueError(f"--api-server-count must be at least 0, got {api_server_count}")
        if tokenizer_workers < 1:
            raise ValueError(f"--tokenizer-workers must be at least 1, got {tokenizer_workers}")
        if tokenizer_listen and len(tokenizer_listen) != tokenizer_workers:
            raise ValueError(
                f"--tokenizer-listen was given {len(tokenizer_listen)} times for "
                f"{tokenizer_workers} tokenizer workers; give it once per worker"
            )
        if any(a.endswith(":*") for a in tokenizer_listen or ()):
            raise ValueError("--tokenizer-listen needs explicit ports (API servers must know them)")
        self.engine_args = engine_args
        # Resolved once, in start(); every child on this host receives it encoded.
        self.config: EngineConfig | None = None
        self.shutdown_timeout = shutdown_timeout
        self._dir = tempfile.mkdtemp(prefix="engine-serve-")
        # Every child inherits the directory, so /metrics shows one view across processes;
        # it goes away with self._dir.
        setup_multiprocess_dir(os.path.join(self._dir, "metrics"))
        self.tokenizer_addresses = tokenizer_listen or [
            f"ipc://{self._dir}/tokenizer-{i}.sock" for i in range(tokenizer_workers)
        ]
        self.api_server_count = api_server_count
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_request_body = max_request_body
        self.chat = chat
        self.disable_ui = disable_ui
        # The chat template travels to the children as a file (it may be long).
        self.chat_template_file: str | None = None
        if chat.chat_template is not None:
            self.chat_template_file = os.path.join(self._dir, "chat_template.jinja")
            Path(self.chat_template_file).write_text(chat.chat_template, encoding="utf-8")
        # Listening from start-up (a busy port fails first, port 0 resolves) until the API
        # servers have inherited it.
        self._port_socket: socket.socket | None = None
        self._cores: list[CoreProcess] = []
        self.engine_addresses: list[str] = []  # every rank's, in rank order
        self.tiers: list[list[Child]] = []
        self._ctx = zmq.Context()
        self._first_host: FirstHost | RayEngineCores | None = None
        self._headless_host: HeadlessHost | None = None
        # Written before the children get SIGTERM (StopOrder), and once every child is ready.
        self._stop_file = os.path.join(self._dir, "stop.json")
        self._serving_file = os.path.join(self._dir, "serving")

    # ---- start-up ----

    def start(
        self, timeout: float = 600.0, stop_requested: Callable[[], bool] = lambda: False
    ) -> None:
        """Start every tier and wait until each child is READY; LaunchError names a failure."""
        if self.api_server_count and not self.http.uds:  # first: a port in use fails early
            try:
                self._port_socket = api_server.listening_socket(self.host, self.port)
            except OSError as e:
                raise LaunchError(
                    f"cannot listen on {self.host}:{self.port}: {e.strerror} "
                    "(is another server using this port?)"
                ) from None
            self.port = self._port_socket.getsockname()[1]
        deadline = time.monotonic() + timeout
        try:
            self.config = resolved_config(**self.engine_args)
        except (ConfigError, OSError, RuntimeError) as e:  # a model that is not there
            raise LaunchError(str(e)) from None
        if self.dp.remote:  # first, so that a port in use fails before the model loads
            try:
                if self.dp.ray:  # Ray actors register as headless hosts' ranks do
                    from frontend.ray_dp_launch import RayEngineCores

                    self._first_host = RayEngineCores(self.engine_args, self.dp.size, timeout)
                else:
                    self._first_host = FirstHost(
                        self._ctx,
                        self.dp.address,
                        self.dp.rpc_port,
                        self.dp.size,
                        self.dp.remote.start,
                        key_from_env(),
                    )
            except RendezvousError as e:
                raise LaunchError(str(e)) from None
        self.tiers.append(self._start_cores())
        if self.dp.headless:
            self._await_ready(self.tiers[0], timeout, stop_requested)
            self._register(max(1.0, deadline - time.monotonic()), stop_requested)
            return
        if self._first_host is not None:
            self._await_registrations(deadline, timeout, stop_requested)
            self.engine_addresses += [self._first_host.addresses[r] for r in self.dp.remote]
        engine_pids = [c.popen.pid for c in self.tiers[0]]
        # Tokenizer processes and API servers import and load their tokenizer while the engine
        # cores load the model; the API servers then wait for the tokenizer processes' READY.
        self.tiers.append(
            [
                self._start_tokenizer(i, a, engine_pids)
                for i, a in enumerate(self.tokenizer_addresses)
            ]
        )
        if self.api_server_count:
            self.tiers.append(
                [
                    self._start_api_server(i, engine_pids[0] if engine_pids else None)
                    for i in range(self.api_server_count)
                ]
            )
            if self._port_socket is not None:  # theirs now: the port closes when they stop
                self._port_socket.close()
                self._port_socket = None
        self._await_ready(
            [c for tier in self.tiers[:2] for c in tier],
            max(1.0, deadline - time.monotonic()),
            stop_requested,
        )
        if self.api_server_count:
            self._await_files(self.tiers[-1], max(1.0, deadline - time.monotonic()), stop_requested)
            Path(self._serving_file).touch()  # /health answers 200 from now on

    def _start_cores(self) -> list[Child]:
        """Start this host's engine cores; a headless host's listen on TCP for the first host."""
        children = []
        host = local_address_towards(self.dp.address) if self.dp.headless else ""
        # Engine cores of one host share its cores: each gets its part of the threads (as the
        # mp executor splits them among TP ranks), unless the user chose a number.
        env = (
            {}
            if len(self.dp.local) <= 1 or "OMP_NUM_THREADS" in os.environ
            else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(self.dp.local)))}
        )
        assert self.config is not None
        for rank in self.dp.local:
            config = self.config if self.dp.size == 1 else self.config.for_rank(rank)
            core = CoreProcess(
                config,
                own_process_group=True,
                extra_env=env,
                address=tcp_address(host, _free_port(host)) if host else None,
            )
            self._cores.append(core)
            self.engine_addresses.append(core.address)
            name = "engine-core" if self.dp.size == 1 else f"engine-core-{rank}"
            children.append(
                Child(
                    name,
                    core.popen,
                    core.address,
                    hello_frames(ClientHello(PROTOCOL_VERSION, "launcher")),
                    output_decoders(),
                )
            )
        return children

    def _await_registrations(
        self, deadline: float, timeout: float, stop_requested: Callable[[], bool]
    ) -> None:
        """Wait until headless hosts registered every rank this host does not run."""
        assert self._first_host is not None
        print(
            f"engine serve: waiting for ranks {self.dp.remote.start}-{self.dp.size - 1} to "
            f"register at {self._first_host.address}",
            flush=True,
        )
        while self._first_host.missing():
            try:
                self._first_host.poll(_POLL_S)
            except RendezvousError as e:
                raise LaunchError(str(e)) from None
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"data-parallel ranks {self._first_host.missing()} did not "
                    f"register within {timeout:.0f} s"
                )
            self._check_start_up([], deadline, timeout, stop_requested)

    def _register(self, timeout: float, stop_requested: Callable[[], bool]) -> None:
        """A headless host: register this host's ready engine cores with the first host."""
        self._headless_host = HeadlessHost(
            self._ctx, self.dp.address, self.dp.rpc_port, key_from_env()
        )

        def check() -> None:
            self._check_start_up([], float("inf"), timeout, stop_requested)

        try:
            self._headless_host.register(self.dp.local.start, self.engine_addresses, timeout, check)
        except RendezvousError as e:
            raise LaunchError(str(e)) from None

    def _start_api_server(self, index: int, engine_pid: int | None) -> Child:
        ready_file = f"{self._dir}/api-{index}.ready"
        args = [
            "--index",
            str(index),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--config",
            self._encoded_config(),
            *(["--engine-pid", str(engine_pid)] if engine_pid else []),
            "--parent-pid",
            str(os.getpid()),
            "--shutdown-timeout",
            str(self.shutdown_timeout),
            "--stop-file",
            self._stop_file,
            "--max-request-body",
            str(self.max_request_body),
            "--ready-file",
            ready_file,
            "--serving-file",
            self._serving_file,
            *self.chat.argv(self.chat_template_file),
        ]
        if self.disable_ui:
            args.append("--disable-ui")
        for address, tokenizer in zip(self.tokenizer_addresses, self.tiers[1]):
            args += ["--tokenizer-address", address, "--tokenizer-pid", str(tokenizer.popen.pid)]
        for address in self.engine_addresses:
            args += ["--engine-address", address]
        args += self.http.argv()
        fds: tuple[int, ...] = ()
        if self._port_socket is not None:
            fds = (self._port_socket.fileno(),)
            args += ["--listen-fd", str(fds[0])]
        # The key travels in the environment, not on the command line that ps shows.
        env = {"ENGINE_API_KEY": self.api_key} if self.api_key else {}
        # Each child in its own session, so Ctrl-C reaches only the launcher.
        popen = spawn_module(
            "frontend.api_server", args, extra_env=env, own_session=True, pass_fds=fds
        )
        return Child(api_server.process_name(index), popen, ready_file, [], {})

    def _await_files(
        self, children: list[Child], timeout: float, stop_requested: Callable[[], bool]
    ) -> None:
        deadline = time.monotonic() + timeout
        while any(c.ready is None for c in children):
            for child in children:
                if child.ready is None and os.path.exists(child.address):
                    child.ready = True
            self._check_start_up(children, deadline, timeout, stop_requested)
            time.sleep(0.05)

    def _start_tokenizer(self, index: int, address: str, engine_pids: list[int]) -> Child:
        template = ["--chat-template", self.chat_template_file] if self.chat_template_file else []
        engines = [a for address in self.engine_addresses for a in ("--engine-address", address)]
        pids = [a for pid in engine_pids for a in ("--engine-pid", str(pid))]
        popen = spawn_module(
            "tokenizer_proc.tokenizer_proc",
            [
                "--index",
                str(index),
                "--listen",
                address,
                *engines,
                "--config",
                self._encoded_config(),
                *pids,
                "--parent-pid",
                str(os.getpid()),
                "--stop-file",
                self._stop_file,
                "--shutdown-timeout",
                str(self.shutdown_timeout),
                *template,
            ],
            own_session=True,
        )
        return Child(
            process_name(index),
            popen,
            address,
            hello_frames(TokenizerHello(TOKENIZER_PROTOCOL_VERSION, "launcher")),
            api_output_decoders(),
        )

    def _encoded_config(self) -> str:
        assert self.config is not None, "start() resolves the configuration first"
        return self.config.encode()

    def _await_ready(
        self, children: list[Child], timeout: float, stop_requested: Callable[[], bool]
    ) -> None:
        sockets = {}
        auth_key = key_from_env()
        for child in children:
            # With a key, the engine cores and tokenizer processes speak CurveZMQ.
            sock, _ = connect_dealer(self._ctx, child.address, auth_key)
            sock.send_multipart(child.hello)
            sockets[sock] = child
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        try:
            while any(c.ready is None for c in children):
                for sock in dict(poller.poll(int(_POLL_S * 1000))):
                    child = sockets[sock]
                    kind, payload = sock.recv_multipart()
                    try:
                        child.ready = ready_or_refused(
                            kind[0],
                            child.decoders[kind[0]].decode(payload),
                            f"{child.name} refused the launcher",
                        )
                    except ConnectionError as e:
                        raise LaunchError(str(e)) from None
                    poller.unregister(sock)
                self._check_start_up(children, deadline, timeout, stop_requested)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _check_start_up(
        self,
        children: list[Child],
        deadline: float,
        timeout: float,
        stop_requested: Callable[[], bool],
    ) -> None:
        """Raise LaunchError when a child died, a signal came, or the deadline passed."""
        self.check_children("during start-up")
        if self._first_host is not None:  # registered hosts wait for answers meanwhile
            try:
                self._first_host.poll(0)
            except RendezvousError as e:
                raise LaunchError(str(e)) from None
        if stop_requested():
            raise StartUpInterrupted("stopped by a signal during start-up")
        if time.monotonic() > deadline:
            late = ", ".join(c.name for c in children if c.ready is None)
            raise LaunchError(f"{late} not ready within {timeout:.0f} s")

    # ---- supervision ----

    def check_children(self, when: str = "unexpectedly") -> None:
        """Raise LaunchError naming the first child that has exited."""
        for tier in self.tiers:
            for child in tier:
                code = child.popen.poll()
                if code is not None:
                    raise LaunchError(
                        f"{child.name} (pid {child.popen.pid}) exited {when} with code {code}"
                    )

    def supervise(self, stop_requested: Callable[[], bool]) -> None:
        """Return when stop_requested() turns true, or a headless host's first host stops it
        without an error; LaunchError when a child (or another host's) dies first."""
        while not stop_requested():
            self.check_children()
            try:
                if self._first_host is not None:
                    self._first_host.poll(_POLL_S)
                elif self._headless_host is not None:
                    stop = self._headless_host.poll(_POLL_S)
                    if stop is not None:
                        if stop.failed:
                            raise LaunchError("the first host stopped on an error")
                        print("engine serve: the first host stopped; stopping", flush=True)
                        self._headless_host.close()
                        self._headless_host = None  # it knows: nothing to tell it
                        return
                else:
                    time.sleep(_POLL_S)
            except RendezvousError as e:
                raise LaunchError(str(e)) from None

    def stop(self, drain: bool, failure: str | None = None, reason: str | None = None) -> list[str]:
        """Stop the tiers in reverse start order; drain lets in-flight requests finish first, for
        up to --shutdown-timeout in all. reason: what clients whose requests are cut are told
        (by default, failure). failure (a child's death) goes to the other hosts of a
        data-parallel group. Returns the children that cut requests."""
        if self._headless_host is not None:
            self._headless_host.fail(failure or "the headless host was stopped")
            self._headless_host.close()
        stopping = "the server is stopping" + (f": {failure}" if failure else "")
        order = StopOrder(
            reason or stopping, time.time() + (self.shutdown_timeout if drain else 0.0)
        )
        order.write(self._stop_file)
        cut = []
        for depth, tier in reversed(list(enumerate(self.tiers))):
            if depth == 0 and self._first_host is not None:  # nobody sends them requests now
                self._first_host.stop(failed=failure is not None)
            # The tiers in front of the engine core (tier 0) drain until the order's deadline.
            timeout = _STOP_TIMEOUT_S + (order.remaining() if depth else 0.0)
            for child in tier:
                if child.popen.poll() is None:
                    child.popen.terminate()
            deadline = time.monotonic() + timeout
            for child in tier:
                try:
                    code = child.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(
                        f"engine serve: {child.name} did not stop in {timeout:.0f} s; killing it",
                        file=sys.stderr,
                        flush=True,
                    )
                    child.popen.kill()
                    code = child.popen.wait()
                if depth and code in (EXIT_REQUESTS_CUT, -signal.SIGKILL):
                    cut.append(child.name)
        if self._first_host is not None:  # closed above unless start-up failed before tier 0
            self._first_host.stop(failed=failure is not None)
        if self._port_socket is not None:
            self._port_socket.close()
        for core in self._cores:
            core.terminate()  # already stopped; removes its socket directory
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        return cut


def _free_port(host: str) -> int:
    """A TCP port that was free on host a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve(
    engine_args: dict[str, Any],
    tokenizer_workers: int = 1,
    tokenizer_listen: list[str] | None = None,
    shutdown_timeout: float = 10.0,
    startup_timeout: float = 600.0,
    api_server_count: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_request_body: int = api_server.DEFAULT_MAX_REQUEST_BODY,
    chat: ChatOptions = ChatOptions(),
    disable_ui: bool = False,
    headless: bool = False,
    http: HttpOptions = HttpOptions(),
) -> int:
    """Run `engine serve` until SIGTERM/SIGINT, at any moment of start-up or serving (exit code
    0, or 1 when requests still running at the --shutdown-timeout deadline were cut), or a
    child's failure (1). headless: only this host's data-parallel engine cores, registered with
    the first host."""
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: signals.append(s))
    began = time.monotonic()
    launcher = Launcher(
        engine_args,
        tokenizer_workers,
        tokenizer_listen,
        shutdown_timeout,
        api_server_count,
        host,
        port,
        api_key,
        max_request_body,
        chat,
        disable_ui=disable_ui,
        headless=headless,
        http=http,
    )
    try:
        launcher.start(startup_timeout, stop_requested=lambda: bool(signals))
        for rank, child in zip(launcher.dp.local, launcher.tiers[0]):
            core = child.ready
            name = "engine core" if launcher.dp.size == 1 else f"engine core rank {rank}"
            print(
                f"{name} listening on {child.address}: model {core.model_name}, "
                f"max_model_len {core.max_model_len}, {core.num_blocks} KV blocks of "
                f"{core.block_size} tokens",
                flush=True,
            )
        for rank in launcher.dp.remote:
            print(
                f"engine core rank {rank} ({'Ray actor' if launcher.dp.ray else 'headless'}) at "
                f"{launcher.engine_addresses[rank]}",
                flush=True,
            )
        for i, address in enumerate(launcher.tokenizer_addresses if not headless else ()):
            print(f"tokenizer {i} listening on {address}", flush=True)
        if launcher.api_server_count:
            print(
                f"API server{'s' if api_server_count > 1 else ''} ({api_server_count}) "
                f"listening on {http.url(launcher.host, launcher.port)}",
                flush=True,
            )
        print(f"engine serve: ready in {time.monotonic() - began:.2f} s", flush=True)
        launcher.supervise(stop_requested=lambda: bool(signals))
    except StartUpInterrupted:
        pass  # drained below, like a signal while serving: requests may already be running
    except LaunchError as e:
        print(f"engine serve: error: {e}; stopping the rest", file=sys.stderr, flush=True)
        launcher.stop(drain=False, failure=str(e))
        return 1
    if not signals:  # a headless host that its first host stopped
        launcher.stop(drain=False)
        print("engine serve: stopped", flush=True)
        return 0
    name = signal.Signals(signals[0]).name
    print(f"engine serve: got {name}; draining for up to {shutdown_timeout} s", flush=True)
    cut = launcher.stop(
        drain=True,
        reason=f"the server is shutting down ({name}) and the "
        f"request did not finish within --shutdown-timeout {shutdown_timeout} s",
    )
    if cut:
        print(
            f"engine serve: error: {', '.join(cut)} cut requests still running at the "
            "--shutdown-timeout deadline",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print("engine serve: stopped", flush=True)
    return 0
