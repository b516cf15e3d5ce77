"""`engine serve`: start the engine cores, the tokenizer processes and the API servers,
supervise them, drain on SIGTERM/SIGINT, and stop everything when any child dies.

Children are started in tiers (engine cores: one per local data-parallel rank,
serve/engine_core_tier.py; then tokenizer processes, each connected to every rank,
serve/tokenizer_tier.py; then the HTTP API servers, serve/api_server_tier.py) and stopped in
the reverse order (serve/supervision.py). With ranks on other hosts, the first host waits for
them to register before it starts its tokenizer processes; `--headless` starts only engine
cores and registers them with the first host (serve/dp_rendezvous.py). The engine core and
tokenizer processes are ready when they answer a HELLO on their socket with READY, an API
server when it has written its ready file (serve/readiness.py); /health answers 200 only once
the launcher has seen every child ready and written the serving file. Every child watches the
launcher's pid and exits when it is gone.

Stopping, the launcher first writes a StopOrder (why, and until when requests may drain: one
deadline for every tier) where the children read it on SIGTERM; a child that had to cut requests
exits EXIT_REQUESTS_CUT, and the launcher then exits 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from config.engine import EngineConfig
from config.errors import ConfigError
from engine_core.core_launcher import CoreProcess
from engine_core.resolve import resolved_config
from frontend import api_server
from frontend.chat_args import ChatOptions
from frontend.http_options import HttpOptions
from frontend.reasoning.registry import check_tokenizer_files
from ipc.curve import key_from_env
from ipc.process import StopOrder
from metrics.exposition import setup_multiprocess_dir
from serve.api_server_tier import ApiServerTier
from serve.child import Child, ChildSettings, LaunchError, StartUpInterrupted
from serve.data_parallel_plan import DataParallelPlan
from serve.dp_rendezvous import FirstHost, HeadlessHost, RendezvousError
from serve.engine_core_tier import start_engine_cores
from serve.readiness import POLL_S, StartUpCheck, await_ready, await_ready_files
from serve.supervision import ExitWatch, check_children, stop_tiers
from serve.tokenizer_tier import start_tokenizer

# Supervising on pidfds and the signal wake-up pipe needs no period; this is a safety net.
_IDLE_WAKE_S = 5.0

if TYPE_CHECKING:  # Ray is optional: imported only with --data-parallel-backend ray
    from serve.ray_engine_cores import RayEngineCores


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
        self.api = ApiServerTier(
            api_server_count, host, port, api_key, max_request_body, chat, disable_ui, http
        )
        # The chat template travels to the children as a file (it may be long).
        self.chat_template_file: str | None = None
        if chat.chat_template is not None:
            self.chat_template_file = os.path.join(self._dir, "chat_template.jinja")
            Path(self.chat_template_file).write_text(chat.chat_template, encoding="utf-8")
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
        self.api.listen()  # first: a port in use fails early

        def check(children: list[Child], deadline: float, timeout: float) -> None:
            self._check_start_up(children, deadline, timeout, stop_requested)

        deadline = time.monotonic() + timeout
        try:
            self.config = resolved_config(**self.engine_args)
            assert self.config.arch is not None
            if self.config.model_path != self.config.model.model:  # a Hub id, a GGUF file
                print(f"engine serve: model from {self.config.model_path}", flush=True)
            self.api.chat.check_model_type(self.config.arch.model_type)  # gpt-oss: harmony
            check_tokenizer_files(self.api.chat.reasoning_parser, self.config.tokenizer_path)
        except (ConfigError, OSError, RuntimeError, ValueError) as e:  # no model, or bad flags
            raise LaunchError(str(e)) from None
        if self.dp.remote:  # first, so that a port in use fails before the model loads
            self._first_host = self._rendezvous(timeout)
        cores, self._cores = start_engine_cores(self.config, self.dp)
        self.engine_addresses += [core.address for core in self._cores]
        self.tiers.append(cores)
        if self.dp.headless:
            await_ready(self._ctx, cores, timeout, check)
            self._register(max(1.0, deadline - time.monotonic()), check)
            return
        if self._first_host is not None:
            self._await_registrations(deadline, timeout, check)
            self.engine_addresses += [self._first_host.addresses[r] for r in self.dp.remote]
        engine_pids = [c.popen.pid for c in cores]
        settings = ChildSettings(
            self.config.encode(),
            os.getpid(),
            self._stop_file,
            self.shutdown_timeout,
            self.chat_template_file,
        )
        # Tokenizer processes and API servers import and load their tokenizer while the engine
        # cores load the model; the API servers then wait for the tokenizer processes' READY.
        tokenizers = [
            start_tokenizer(settings, i, address, self.engine_addresses, engine_pids)
            for i, address in enumerate(self.tokenizer_addresses)
        ]
        self.tiers.append(tokenizers)
        if self.api.count:
            self.tiers.append(
                self.api.start(
                    settings,
                    self._dir,
                    self._serving_file,
                    tokenizers,
                    self.engine_addresses,
                    engine_pids[0] if engine_pids else None,
                )
            )
        await_ready(self._ctx, cores + tokenizers, max(1.0, deadline - time.monotonic()), check)
        if self.api.count:
            await_ready_files(self.tiers[-1], max(1.0, deadline - time.monotonic()), check)
            Path(self._serving_file).touch()  # /health answers 200 from now on

    def _rendezvous(self, timeout: float) -> FirstHost | RayEngineCores:
        """Where the ranks this host does not run register: Ray actors, or headless hosts."""
        try:
            if self.dp.ray:  # Ray actors register as headless hosts' ranks do
                from serve.ray_engine_cores import RayEngineCores

                return RayEngineCores(self.engine_args, self.dp.size, timeout)
            return FirstHost(
                self._ctx,
                self.dp.address,
                self.dp.rpc_port,
                self.dp.size,
                self.dp.remote.start,
                key_from_env(),
            )
        except RendezvousError as e:
            raise LaunchError(str(e)) from None

    def _await_registrations(
        self,
        deadline: float,
        timeout: float,
        check: StartUpCheck,
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
                self._first_host.poll(POLL_S)
            except RendezvousError as e:
                raise LaunchError(str(e)) from None
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"data-parallel ranks {self._first_host.missing()} did not "
                    f"register within {timeout:.0f} s"
                )
            check([], deadline, timeout)

    def _register(self, timeout: float, check: StartUpCheck) -> None:
        """A headless host: register this host's ready engine cores with the first host."""
        self._headless_host = HeadlessHost(
            self._ctx, self.dp.address, self.dp.rpc_port, key_from_env()
        )
        try:
            self._headless_host.register(
                self.dp.local.start,
                self.engine_addresses,
                timeout,
                lambda: check([], float("inf"), timeout),
            )
        except RendezvousError as e:
            raise LaunchError(str(e)) from None

    def _check_start_up(
        self,
        children: list[Child],
        deadline: float,
        timeout: float,
        stop_requested: Callable[[], bool],
    ) -> None:
        """Raise LaunchError when a child died, a signal came, or the deadline passed."""
        check_children(self.tiers, "during start-up")
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

    def supervise(self, stop_requested: Callable[[], bool]) -> None:
        """Return when stop_requested() turns true, or a headless host's first host stops it
        without an error; LaunchError when a child (or another host's) dies first."""
        with ExitWatch(self.tiers) as exits:
            self._supervise(stop_requested, exits)

    def _supervise(self, stop_requested: Callable[[], bool], exits: ExitWatch) -> None:
        while not stop_requested():
            check_children(self.tiers)
            try:
                if self._first_host is not None:
                    self._first_host.poll(POLL_S)
                elif self._headless_host is not None:
                    stop = self._headless_host.poll(POLL_S)
                    if stop is not None:
                        if stop.failed:
                            raise LaunchError("the first host stopped on an error")
                        print("engine serve: the first host stopped; stopping", flush=True)
                        self._headless_host.close()
                        self._headless_host = None  # it knows: nothing to tell it
                        return
                else:
                    exits.wait(_IDLE_WAKE_S)
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

        def stop_other_hosts() -> None:
            if self._first_host is not None:
                self._first_host.stop(failed=failure is not None)

        cut = stop_tiers(self.tiers, order, before_engine_cores=stop_other_hosts)
        stop_other_hosts()  # done above unless start-up failed before tier 0
        self.api.close()
        for core in self._cores:
            core.terminate()  # already stopped; removes its socket directory
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        return cut


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
        _announce(launcher)
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


def _announce(launcher: Launcher) -> None:
    """Print where every process of a started launch listens (tests and users read it)."""
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
    for i, address in enumerate(launcher.tokenizer_addresses if not launcher.dp.headless else ()):
        print(f"tokenizer {i} listening on {address}", flush=True)
    if launcher.api.count:
        print(
            f"API server{'s' if launcher.api.count > 1 else ''} ({launcher.api.count}) "
            f"listening on {launcher.api.url()}",
            flush=True,
        )
