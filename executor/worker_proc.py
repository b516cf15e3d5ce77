"""The worker process behind MultiprocExecutor: one rank's main loop."""

from __future__ import annotations

import collections
import signal
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

from executor.shm_broadcast import Doorbell, ShmRingReader
from executor.worker_messages import (
    AllocateKVCache,
    Command,
    Failed,
    KVCacheReady,
    Loaded,
    RunStep,
    StepDone,
    WorkerArgs,
)
from gpu_worker.async_output import AsyncOutput, ReadyOutput
from gpu_worker.worker import Worker
from ipc.process import set_process_name, watch_parent

_POLL_S = 50e-6  # between checks of the ring and the device while a step's output is pending


def worker_main(
    encoded_args: bytes, replies: Connection, lifeline: Connection, doorbell: Doorbell | None = None
) -> None:
    """Entry point of a spawned worker: serve commands from the ring until Shutdown."""
    args = msgspec.msgpack.decode(encoded_args, type=WorkerArgs)
    # Exit when the executor's process dies, even by SIGKILL: the kernel's parent-death signal
    # fires when the thread that started this process exits (so the executor must live on a
    # thread that outlives it); the lifeline, a pipe whose only writer is the parent, covers
    # the rest (EOF when the parent is gone).
    watch_parent(args.parent_pid, lifeline=lifeline, kill_with_parent=True)
    set_process_name(f"engine-worker-{args.rank}")
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


def _serve(
    args: WorkerArgs, reader: ShmRingReader, replies: Connection, encoder: msgspec.msgpack.Encoder
) -> None:
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
