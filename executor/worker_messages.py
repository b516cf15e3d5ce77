"""What MultiprocExecutor and its worker processes say to each other: msgspec structs, no pickle.

Commands go to every rank at once through the shared-memory ring; replies come back over each
worker's own pipe (every rank while starting up, only rank 0 for steps).
"""

from __future__ import annotations

import msgspec

from config.engine import EngineConfig
from executor.shm_broadcast import RingHandle
from protocol.step import ModelRunnerOutput, SchedulerOutput


class WorkerArgs(msgspec.Struct):
    """Everything a worker process needs to start."""

    rank: int
    config: EngineConfig
    ring: RingHandle
    distributed_init_method: str
    num_threads: int
    parent_pid: int


class RunStep(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Run one step."""

    scheduler_output: SchedulerOutput


class AllocateKVCache(msgspec.Struct, tag=True, array_like=True):
    """Allocate the KV cache with the block count every rank can hold."""

    num_blocks: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Leave the group and exit."""


Command = RunStep | AllocateKVCache | Shutdown


class Loaded(msgspec.Struct, tag=True, array_like=True):
    """The model is loaded; this rank can hold num_blocks KV blocks."""

    num_blocks: int


class KVCacheReady(msgspec.Struct, tag=True, array_like=True):
    """The KV cache is allocated."""


class StepDone(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Rank 0's output of a step."""

    output: ModelRunnerOutput


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The worker raised; it exits after sending this."""

    traceback: str


Reply = Loaded | KVCacheReady | StepDone | Failed
