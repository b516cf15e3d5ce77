"""The worker process behind MultiprocExecutor: one rank's main loop."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

from executor.shm_broadcast import Doorbell, ShmRingReader
from executor.worker_messages import (AllocateKVCache, Command, Failed, KVCacheReady, Loaded,
                                      RunStep, StepDone, WorkerArgs)
from gpu_worker.async_output import AsyncOutput, ReadyOutput
from gpu_worker.worker import Worker

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_POLL_S = 50e-6  # between checks of the ring and the device while a step's output is pending


def worker_main(encoded_args: bytes, replies: Connection, lifeline: Connection,
                doorbell: Doorbell | None = None) -> None:
    """Entry point of a spawned worker: serve commands from the ring until Shutdown."""
    args = msgspec.msgpack.decode(encoded_args, type=WorkerArgs)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    _die_with_parent(libc, args.parent_pid, lifeline)
    libc.prctl(PR_SET_NAME, f"engine-worker-{args.rank}".encode()[:15], 0, 0, 0)
    # Ctrl-C reaches the whole process group; the engine decides when workers stop. SIGTERM may
    # come blocked from the engine core process, which sigwait()s for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    torch.set_num_threads(args.num_threads)
    encoder = msgspec.msgpack.Encoder()
    reader = ShmRingReader(args.ring, args.rank, doorbell)
    try:
        _serve(args, reader, replies, encoder)
    except Exception:
        traceback.print_exc()
        try:
            replies.send_bytes(encoder.encode(Failed(traceback.format_exc())))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        reader.close()


def _serve(args: WorkerArgs, reader: ShmRingReader, replies: Connection,
           encoder: msgspec.msgpack.Encoder) -> None:
    worker = Worker(args.config, args.rank, args.distributed_init_method)
    worker.load_model()
    replies.send_bytes(encoder.encode(Loaded(worker.determine_num_blocks())))
    decoder = msgspec.msgpack.Decoder(Command)
    # Rank 0's launched steps whose outputs are not sent yet. A step's output is sent once its
    # copy is done, unless the next step arrives first: then that one is launched before, so
    # the device never waits for this process to read a result (async scheduling).
    pending: collections.deque[AsyncOutput | ReadyOutput] = collections.deque()
    while True:
        while pending and not reader.poll():
            if pending[0].ready():
                replies.send_bytes(encoder.encode(StepDone(pending.popleft().get_output())))
            else:
                time.sleep(_POLL_S)
        command = reader.read(decoder.decode)
        if isinstance(command, RunStep):
            output = worker.execute_model_async(command.scheduler_output)
            if args.rank == 0:
                pending.append(output)
            continue
        while pending:
            replies.send_bytes(encoder.encode(StepDone(pending.popleft().get_output())))
        if isinstance(command, AllocateKVCache):
            worker.initialize_kv_cache(command.num_blocks)
            replies.send_bytes(encoder.encode(KVCacheReady()))
        else:
            worker.shutdown()
            return


def _die_with_parent(libc: ctypes.CDLL, parent_pid: int, lifeline: Connection) -> None:
    """Exit when the executor's process dies, even by SIGKILL.

    The kernel's parent-death signal fires when the thread that started this process exits, so
    the executor must live on a thread that outlives it. The watchdog thread covers the rest:
    it blocks on a pipe whose only writer is the parent, and reads EOF when the parent is gone.
    """
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
