"""The multiprocess executor: one worker process per tensor-parallel rank on this host."""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import msgspec
import torch

from config.engine import EngineConfig
from executor.base import Executor, StepFuture, WorkerError
from executor.shm_broadcast import ShmRingWriter
from executor.worker_messages import (
    AllocateKVCache,
    Command,
    Failed,
    KVCacheReady,
    Loaded,
    Reply,
    RunStep,
    Shutdown,
    StepDone,
    WorkerArgs,
)
from executor.worker_proc import worker_main
from protocol.step import ModelRunnerOutput, SchedulerOutput

SHUTDOWN_TIMEOUT_S = 5.0


class MultiprocExecutor(Executor):
    """One worker process per rank; each step goes out once through a shared-memory ring.

    Only rank 0 replies: every rank samples the same tokens. The executor must be created on a
    thread that lives as long as it: workers get SIGKILL when that thread exits
    (PR_SET_PDEATHSIG), so that no worker outlives a crashed engine.
    """

    def __init__(self, config: EngineConfig, num_threads: int | None = None) -> None:
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        # Each worker's torch threads: the engine process's share per rank unless given.
        self.num_threads = num_threads or max(1, torch.get_num_threads() // self.world_size)
        self.procs: list[BaseProcess] = []
        self._replies: list[Connection] = []
        self._lifelines: list[Connection] = []
        self._ring: ShmRingWriter | None = None
        self._pending: collections.deque[_PendingStep] = collections.deque()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)

    def initialize(self) -> int:
        """Start the workers, load the model on each, and allocate the smallest block count."""
        # Starting Python's resource tracker unblocks SIGINT and SIGTERM in this thread; a caller
        # that blocks them to sigwait() (the engine core process does) must keep its mask.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        try:
            self._start_workers()
            loaded = self._collect(range(self.world_size), Loaded)
            num_blocks = min(reply.num_blocks for reply in loaded)
            self._broadcast(AllocateKVCache(num_blocks))
            self._collect(range(self.world_size), KVCacheReady)
        except BaseException:
            self.shutdown()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return num_blocks

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ring = ShmRingWriter(num_readers=self.world_size, ctx=ctx)
        init_method = f"tcp://127.0.0.1:{_free_port()}" if self.world_size > 1 else ""
        for rank in range(self.world_size):
            args = WorkerArgs(
                rank, self.config, self._ring.handle, init_method, self.num_threads, os.getpid()
            )
            replies, replies_child = ctx.Pipe(duplex=False)
            lifeline_child, lifeline = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                name=f"engine-worker-{rank}",
                daemon=True,
                args=(
                    msgspec.msgpack.encode(args),
                    replies_child,
                    lifeline_child,
                    self._ring.doorbells[rank],
                ),
            )
            proc.start()
            # Only the child may hold these ends: EOF on them must mean that one process is gone.
            replies_child.close()
            lifeline_child.close()
            self.procs.append(proc)
            self._replies.append(replies)
            self._lifelines.append(lifeline)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast the step and wait for rank 0's output; WorkerError if any rank fails."""
        return self.submit(scheduler_output).result()

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Broadcast the step and return; its output is rank 0's next unread reply."""
        self._broadcast(RunStep(scheduler_output))
        step = _PendingStep(self)
        self._pending.append(step)
        return step

    def _read_until(self, step: _PendingStep) -> None:
        """Read rank 0's replies, oldest step first, until step has its output."""
        while step.output is None:
            self._pending.popleft().output = self._collect([0], StepDone)[0].output

    def shutdown(self) -> None:
        """Ask the workers to exit, join them in rank order, kill what is left, free the ring."""
        if self._ring is None:
            return
        if all(proc.is_alive() for proc in self.procs):
            try:
                self._broadcast(Shutdown(), timeout=SHUTDOWN_TIMEOUT_S)
            except (TimeoutError, WorkerError):
                pass
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        # A worker that is gone leaves the others blocked in a collective: no use waiting.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in (*self._replies, *self._lifelines):
            conn.close()
        self._ring.close()
        self._ring = None

    def _broadcast(self, command: Command, timeout: float | None = None) -> None:
        assert self._ring is not None, "initialize() first"
        self._ring.write(self._encoder.encode(command), timeout, on_wait=self._check_alive)

    def _collect(self, ranks: range | list[int], kind: type) -> list:
        """One reply of type kind from each of ranks, in rank order.

        Waits on the pipes and on every worker's process sentinel at once, so the failure or
        death of any rank, awaited or not, raises WorkerError at once.
        """
        pending = set(ranks)
        got: dict[int, Reply] = {}
        sentinels = [proc.sentinel for proc in self.procs]
        while pending:
            ready = wait([*(self._replies[rank] for rank in pending), *sentinels])
            if any(sentinel in ready for sentinel in sentinels):
                raise self._failure()
            for rank in [rank for rank in pending if self._replies[rank] in ready]:
                try:
                    reply = self._decoder.decode(self._replies[rank].recv_bytes())
                except (EOFError, OSError):
                    raise self._failure() from None
                if not isinstance(reply, kind):
                    raise self._failure({rank: reply})
                got[rank] = reply
                pending.discard(rank)
        return [got[rank] for rank in sorted(got)]

    def _check_alive(self) -> None:
        if not all(proc.is_alive() for proc in self.procs):
            raise self._failure()

    def _failure(self, received: dict[int, Reply] | None = None) -> WorkerError:
        """What is known of the failed workers.

        Those that died without a word come first, as the likely cause: a rank's peers fail in
        their collectives once it is gone. Then the errors that ranks reported.
        """
        replies = dict(received or {})
        for rank, conn in enumerate(self._replies):
            try:
                while conn.poll():
                    replies[rank] = self._decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                pass
        silent, reported = [], []
        for rank, proc in enumerate(self.procs):
            reply = replies.get(rank)
            if isinstance(reply, Failed):
                reported.append(f"engine worker rank {rank} failed:\n{reply.traceback}")
            elif reply is not None:
                reported.append(
                    f"engine worker rank {rank} sent an unexpected {type(reply).__name__}"
                )
            elif wait([proc.sentinel], timeout=0):  # is_alive() may lag the sentinel
                proc.join(1.0)
                code = proc.exitcode
                how = (
                    f"was killed by {signal.Signals(-code).name}"
                    if code is not None and code < 0
                    else f"exited with code {code}"
                )
                silent.append(f"engine worker rank {rank} (pid {proc.pid}) {how}")
        return WorkerError("; ".join(silent + reported) or "engine workers failed")


class _PendingStep:
    """A broadcast step whose output has not been read yet."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None  # set once rank 0's reply is read

    def result(self) -> ModelRunnerOutput:
        self._executor._read_until(self)
        assert self.output is not None
        return self.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
