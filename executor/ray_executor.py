"""The Ray executor: one Ray actor per tensor-parallel rank, placed by a placement group on the
nodes of a Ray cluster (docs/scale-out.md, "Ray").

Each step is one actor call per rank carrying the SchedulerOutput as msgspec bytes; rank 0's
call returns the output, the others' return None and are awaited only to surface their
failure. The tensor-parallel group meets at rank 0's node (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import re

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine_core.config import EngineConfig
from executor.base import Executor, StepFuture, WorkerError
from executor.ray_cluster import PLACEMENT_TIMEOUT_S, connect, death_reason, reserve
from executor.ray_worker import EngineWorker
from gpu_worker.protocol import ModelRunnerOutput, SchedulerOutput

SHUTDOWN_TIMEOUT_S = 5.0
_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the header of a remote traceback
FAILURE_GRACE_S = 2.0  # after one rank fails, how long the others' news is awaited


class RayExecutor(Executor):
    """Workers as Ray actors, one per rank, in a placement group of one bundle per rank."""

    def __init__(self, config: EngineConfig,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self.placement_timeout_s = placement_timeout_s
        self.actors: list[ray.actor.ActorHandle] = []
        self.locations: list[tuple[str, str, int]] = []  # (node id, node IP, pid) per rank
        self._group: PlacementGroup | None = None
        self._connected = False
        self._failed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)

    def initialize(self) -> int:
        """Reserve the bundles, start the actors, load the model on each, and allocate the
        smallest block count."""
        try:
            self._connected = connect()
            resource = "GPU" if self.config.device_type == "cuda" else "CPU"
            self._group = reserve(self.world_size, resource, self.placement_timeout_s)
            self._start_actors(resource)
            self.locations = self._gather([actor.where.remote() for actor in self.actors])
            init_method = (self._gather([self.actors[0].free_tcp_address.remote()])[0]
                           if self.world_size > 1 else "")
            config = msgspec.msgpack.encode(self.config)
            num_blocks = min(self._gather([actor.load_model.remote(config, init_method)
                                           for actor in self.actors]))
            self._gather([actor.initialize_kv_cache.remote(num_blocks) for actor in self.actors])
        except BaseException:
            self.shutdown()
            raise
        return num_blocks

    def _start_actors(self, resource: str) -> None:
        cls = ray.remote(EngineWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._group,
                                                        placement_group_bundle_index=rank)
            self.actors.append(cls.options(
                num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
                scheduling_strategy=strategy).remote(rank))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank and return rank 0's output; WorkerError if any fails."""
        return self.submit(scheduler_output).result()

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Send the step to every rank and return; its output is rank 0's answer."""
        step = self._encoder.encode(scheduler_output)
        return _RayStep(self, [actor.execute_model.remote(step) for actor in self.actors])

    def _gather(self, refs: list[ray.ObjectRef]) -> list:
        """Each rank's answer, in rank order. The first failure, awaited or not, raises
        WorkerError at once (a rank left waiting in a collective for a dead peer never would)."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except RayError:
                raise self._failure(refs) from None
        return ray.get(refs)

    def _failure(self, refs: list[ray.ObjectRef]) -> WorkerError:
        """What is known of the failed ranks: the dead ones first, as the likely cause (their
        peers fail in a collective once they are gone), then the errors that ranks raised."""
        self._failed = True
        ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)
        dead, raised = [], []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                dead.append(f"engine worker rank {rank} ({self._where(rank)}) died: "
                            f"{death_reason(e)}")
            except GetTimeoutError:
                pass
            except RayError as e:  # RayTaskError: the actor's method raised; its traceback
                trace = _ANSI_COLOR.sub("", str(e)).strip()
                raised.append(f"engine worker rank {rank} ({self._where(rank)}) failed:\n{trace}")
        return WorkerError("; ".join(dead + raised) or "engine workers failed")

    def _where(self, rank: int) -> str:
        if rank >= len(self.locations):
            return "Ray actor"
        node_id, ip, pid = self.locations[rank]
        return f"Ray actor, pid {pid} on node {node_id[:12]} at {ip}"

    def shutdown(self) -> None:
        """Ask the actors to leave their group, kill them, free the bundles, disconnect."""
        if self.actors and not self._failed:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors],
                        timeout=SHUTDOWN_TIMEOUT_S)
            except RayError:
                pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._connected:
            ray.shutdown()
            self._connected = False


class _RayStep:
    """A step sent to every rank; result() waits for all of them, returns rank 0's output."""

    def __init__(self, executor: RayExecutor, refs: list[ray.ObjectRef]) -> None:
        self._executor = executor
        self._refs = refs

    def result(self) -> ModelRunnerOutput:
        return self._executor._decoder.decode(self._executor._gather(self._refs)[0])
