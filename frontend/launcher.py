"""`engine serve`: start the engine core and the tokenizer processes, supervise them, drain on
SIGTERM/SIGINT, and stop everything when any child dies.

Children are started in tiers (engine core, then tokenizer processes, then the HTTP API
servers) and stopped in the reverse order. The engine core and tokenizer processes are ready
when they answer a HELLO on their socket with READY, an API server when it has written its
ready file; every child watches the launcher's pid and exits when it is gone.
"""

from __future__ import annotations

import json
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
from typing import Any

import msgspec
import zmq

from engine_core.core_launcher import CoreProcess
from engine_core.frames import FrameDecoder
from engine_core.protocol import PROTOCOL_VERSION, ClientHello, output_decoders
from frontend import api_server
from frontend.chat_args import ChatOptions
from metrics.exposition import setup_multiprocess_dir
from tokenizer_proc.protocol import (TOKENIZER_PROTOCOL_VERSION, TokenizerHello,
                                     api_output_decoders)
from tokenizer_proc.tokenizer_proc import process_name

_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
_POLL_S = 0.2
# How long a child may take to exit after SIGTERM when nothing is being drained.
_STOP_TIMEOUT_S = 10.0


class LaunchError(RuntimeError):
    """A child failed to start or died; the message names it."""


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

    def __init__(self, engine_args: dict[str, Any], tokenizer_workers: int = 1,
                 tokenizer_listen: list[str] | None = None,
                 shutdown_timeout: float = 10.0, api_server_count: int = 1,
                 host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_request_body: int = api_server.DEFAULT_MAX_REQUEST_BODY,
                 chat: ChatOptions = ChatOptions(), disable_ui: bool = False) -> None:
        if api_server_count < 0:
            raise ValueError(f"--api-server-count must be at least 0, got {api_server_count}")
        if tokenizer_workers < 1:
            raise ValueError(f"--tokenizer-workers must be at least 1, got {tokenizer_workers}")
        if tokenizer_listen and len(tokenizer_listen) != tokenizer_workers:
            raise ValueError(f"--tokenizer-listen was given {len(tokenizer_listen)} times for "
                             f"{tokenizer_workers} tokenizer workers; give it once per worker")
        if any(a.endswith(":*") for a in tokenizer_listen or ()):
            raise ValueError("--tokenizer-listen needs explicit ports (API servers must know them)")
        self.engine_args = engine_args
        self.shutdown_timeout = shutdown_timeout
        self._dir = tempfile.mkdtemp(prefix="engine-serve-")
        # Every child inherits the directory, so /metrics shows one view across processes;
        # it goes away with self._dir.
        setup_multiprocess_dir(os.path.join(self._dir, "metrics"))
        self.tokenizer_addresses = tokenizer_listen or [
            f"ipc://{self._dir}/tokenizer-{i}.sock" for i in range(tokenizer_workers)]
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
        # Held (bound, not listening) from start-up to stop: reserves the port, resolves port 0.
        self._port_socket: socket.socket | None = None
        self._core: CoreProcess | None = None
        self.tiers: list[list[Child]] = []
        self._ctx = zmq.Context()

    # ---- start-up ----

    def start(self, timeout: float = 600.0,
              stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Start every tier and wait until each child is READY; LaunchError names a failure."""
        if self.api_server_count:  # first: a port in use fails before the model loads
            try:
                self._port_socket = api_server.reuseport_socket(self.host, self.port, listen=False)
            except OSError as e:
                raise LaunchError(f"cannot bind {self.host}:{self.port}: {e}") from None
            self.port = self._port_socket.getsockname()[1]
        self._core = CoreProcess(self.engine_args, own_process_group=True)
        core = Child("engine-core", self._core.popen, self._core.address,
                     _hello_frames(ClientHello(PROTOCOL_VERSION, "launcher")), output_decoders())
        self.tiers.append([core])
        # Tokenizer processes load their tokenizer while the engine core loads the model.
        self.tiers.append([self._start_tokenizer(i, a, core.popen.pid)
                           for i, a in enumerate(self.tokenizer_addresses)])
        deadline = time.monotonic() + timeout
        self._await_ready([c for tier in self.tiers for c in tier], timeout, stop_requested)
        if self.api_server_count:
            self.tiers.append([self._start_api_server(i, core.popen.pid)
                               for i in range(self.api_server_count)])
            self._await_files(self.tiers[-1], max(1.0, deadline - time.monotonic()),
                              stop_requested)

    def _start_api_server(self, index: int, engine_pid: int) -> Child:
        ready_file = f"{self._dir}/api-{index}.ready"
        args = ["frontend.api_server", "--index", str(index), "--host", self.host,
                "--port", str(self.port), "--engine-args", json.dumps(self.engine_args),
                "--engine-pid", str(engine_pid), "--parent-pid", str(os.getpid()),
                "--shutdown-timeout", str(self.shutdown_timeout),
                "--max-request-body", str(self.max_request_body), "--ready-file", ready_file,
                *self.chat.argv(self.chat_template_file)]
        if self.disable_ui:
            args.append("--disable-ui")
        for address in self.tokenizer_addresses:
            args += ["--tokenizer-address", address]
        # The key travels in the environment, not on the command line that ps shows.
        env = {"ENGINE_API_KEY": self.api_key} if self.api_key else {}
        return Child(api_server.process_name(index), _spawn(args, env), ready_file, [], {})

    def _await_files(self, children: list[Child], timeout: float,
                     stop_requested: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while any(c.ready is None for c in children):
            for child in children:
                if child.ready is None and os.path.exists(child.address):
                    child.ready = True
            self._check_start_up(children, deadline, timeout, stop_requested)
            time.sleep(0.05)

    def _start_tokenizer(self, index: int, address: str, engine_pid: int) -> Child:
        assert self._core is not None
        template = ["--chat-template", self.chat_template_file] if self.chat_template_file else []
        popen = _spawn(["tokenizer_proc.tokenizer_proc", "--index", str(index), "--listen", address,
                        "--engine-address", self._core.address,
                        "--engine-args", json.dumps(self.engine_args),
                        "--engine-pid", str(engine_pid), "--parent-pid", str(os.getpid()),
                        "--shutdown-timeout", str(self.shutdown_timeout), *template])
        return Child(process_name(index), popen, address,
                     _hello_frames(TokenizerHello(TOKENIZER_PROTOCOL_VERSION, "launcher")),
                     api_output_decoders())

    def _await_ready(self, children: list[Child], timeout: float,
                     stop_requested: Callable[[], bool]) -> None:
        sockets = {}
        for child in children:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(child.address)
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
                    msg = child.decoders[kind[0]].decode(payload)
                    if kind[0] != 0:  # READY is type 0 in both protocols
                        raise LaunchError(f"{child.name} refused the launcher: {msg.message}")
                    child.ready = msg
                    poller.unregister(sock)
                self._check_start_up(children, deadline, timeout, stop_requested)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _check_start_up(self, children: list[Child], deadline: float, timeout: float,
                        stop_requested: Callable[[], bool]) -> None:
        """Raise LaunchError when a child died, a signal came, or the deadline passed."""
        self.check_children("during start-up")
        if stop_requested():
            raise LaunchError("stopped by a signal during start-up")
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
                    raise LaunchError(f"{child.name} (pid {child.popen.pid}) exited {when} "
                                      f"with code {code}")

    def supervise(self, stop_requested: Callable[[], bool]) -> None:
        """Return when stop_requested() turns true; LaunchError when a child dies first."""
        while not stop_requested():
            self.check_children()
            time.sleep(_POLL_S)

    def stop(self, drain: bool) -> None:
        """Stop the tiers in reverse start order; drain lets in-flight requests finish first."""
        for depth, tier in reversed(list(enumerate(self.tiers))):
            # Every tier in front of the engine core (tier 0) may be draining requests.
            timeout = self.shutdown_timeout + _STOP_TIMEOUT_S if drain and depth else \
                _STOP_TIMEOUT_S
            for child in tier:
                if child.popen.poll() is None:
                    child.popen.terminate()
            deadline = time.monotonic() + timeout
            for child in tier:
                try:
                    child.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"engine serve: {child.name} did not stop in {timeout} s; killing it",
                          file=sys.stderr, flush=True)
                    child.popen.kill()
                    child.popen.wait()
        if self._port_socket is not None:
            self._port_socket.close()
        if self._core is not None:
            self._core.terminate()  # already stopped; removes its socket directory
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _hello_frames(hello: msgspec.Struct) -> list[bytes]:
    return [b"\x00", msgspec.msgpack.encode(hello)]


def _spawn(module_args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run `python -m <module_args>` in its own session, so Ctrl-C reaches only the launcher."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", *module_args], env=env, start_new_session=True)


def serve(engine_args: dict[str, Any], tokenizer_workers: int = 1,
          tokenizer_listen: list[str] | None = None, shutdown_timeout: float = 10.0,
          startup_timeout: float = 600.0, api_server_count: int = 1, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None,
          max_request_body: int = api_server.DEFAULT_MAX_REQUEST_BODY,
          chat: ChatOptions = ChatOptions(), disable_ui: bool = False) -> int:
    """Run `engine serve` until SIGTERM/SIGINT (exit code 0) or a child's failure (1)."""
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: signals.append(s))
    launcher = Launcher(engine_args, tokenizer_workers, tokenizer_listen, shutdown_timeout,
                        api_server_count, host, port, api_key, max_request_body, chat,
                        disable_ui=disable_ui)
    try:
        launcher.start(startup_timeout, stop_requested=lambda: bool(signals))
        core = launcher.tiers[0][0].ready
        print(f"engine core listening on {launcher.tiers[0][0].address}: model "
              f"{core.model_name}, max_model_len {core.max_model_len}, {core.num_blocks} KV "
              f"blocks of {core.block_size} tokens", flush=True)
        for i, address in enumerate(launcher.tokenizer_addresses):
            print(f"tokenizer {i} listening on {address}", flush=True)
        if api_server_count:
            host = f"[{launcher.host}]" if ":" in launcher.host else launcher.host
            print(f"API server{'s' if api_server_count > 1 else ''} ({api_server_count}) "
                  f"listening on http://{host}:{launcher.port}", flush=True)
        print("engine serve: ready", flush=True)
        launcher.supervise(stop_requested=lambda: bool(signals))
    except LaunchError as e:
        print(f"engine serve: error: {e}; stopping the rest", file=sys.stderr, flush=True)
        launcher.stop(drain=False)
        return 1
    print(f"engine serve: got {signal.Signals(signals[0]).name}; draining for up to "
          f"{shutdown_timeout} s", flush=True)
    launcher.stop(drain=True)
    print("engine serve: stopped", flush=True)
    return 0
