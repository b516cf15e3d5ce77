"""The Ray executor: one Ray actor per tensor-parallel rank, placed by a placement group on the
nodes of a Ray cluster (docs/scale-out.md, "Ray").

Each step is encoded once (msgspec). The ranks on the engine core's own node ("ring ranks")
read it from a shared-memory ring (executor/shm_broadcast.py, as the mp executor's workers do),
each on a thread of its own started by one serve_ring() call at initialisation; the other
ranks get it by one actor call each. Rank 0 answers with the output: by the return value of its
call, or, as a ring rank, through a ring of its own that the engine core reads. Every rank's
call is awaited, and every ring rank's serve_ring() call is watched, only to surface its
failure or death. The tensor-parallel group meets at rank 0's node (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import collections
import re
import signal
from collections.abc import Callable

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from config.engine import EngineConfig
from executor.base import Executor, StepFuture, WorkerError
from executor.ray_cluster import PLACEMENT_TIMEOUT_S, connect, death_reason, reserve
from executor.ray_worker import RING_GROUP, EngineWorker
from executor.shm_broadcast import HostDoorbell, ShmRingReader, ShmRingWriter
from executor.worker_messages import RunStep, Shutdown
from protocol.step import ModelRunnerOutput, SchedulerOutput

SHUTDOWN_TIMEOUT_S = 5.0
_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the header of a remote traceback
FAILURE_GRACE_S = 2.0  # after one rank fails, how long the others' news is awaited


class RayExecutor(Executor):
    """Workers as Ray actors, one per rank, in a placement group of one bundle per rank."""

    def __init__(
        self, config: EngineConfig, placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    ) -> None:
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self.placement_timeout_s = placement_timeout_s
        self.actors: list[ray.actor.ActorHandle] = []
        self.locations: list[tuple[str, str, int]] = []  # (node id, node IP, pid) per rank
        self.ring_ranks: list[int] = []  # the ranks on this node, which read the ring
        self._ring: ShmRingWriter | None = None
        self._readers: dict[int, ray.ObjectRef] = {}  # ring rank -> its serve_ring() call
        self._replies: ShmRingReader | None = None  # rank 0's outputs, when it reads the ring
        self._replies_bell: HostDoorbell | None = None
        self._pending: collections.deque[_RayStep] = collections.deque()  # outputs unread
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
            self.locations = self._gather_all(lambda actor: actor.where.remote())
            init_method = (
                self._gather({0: self.actors[0].free_tcp_address.remote()})[0]
                if self.world_size > 1
                else ""
            )
            config = msgspec.msgpack.encode(self.config)
            num_blocks = min(
                self._gather_all(lambda actor: actor.load_model.remote(config, init_method))
            )
            self._gather_all(lambda actor: actor.initialize_kv_cache.remote(num_blocks))
            self._start_ring()
        except BaseException:
            self.shutdown()
            raise
        return num_blocks

    def _start_actors(self, resource: str) -> None:
        """One actor per bundle; those placed on this node get a thread for the ring (a
        concurrency group), the others stay single-threaded, running their calls in order."""
        assert self._group is not None
        here = ray.get_runtime_context().get_node_id()
        nodes = placement_group_table(self._group)["bundles_to_node_id"]
        self.ring_ranks = [rank for rank in range(self.world_size) if nodes[rank] == here]
        remote_cls = ray.remote(EngineWorker)
        ring_cls = ray.remote(concurrency_groups={RING_GROUP: 1})(EngineWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=rank
            )
            cls = ring_cls if rank in self.ring_ranks else remote_cls
            self.actors.append(
                cls.options(
                    num_cpus=1 if resource == "CPU" else 0,
                    num_gpus=1 if resource == "GPU" else 0,
                    scheduling_strategy=strategy,
                ).remote(rank)
            )

    def _start_ring(self) -> None:
        """The ring, and one serve_ring() call per ring rank, which returns only at Shutdown."""
        if not self.ring_ranks:
            return
        # Python's resource tracker, started with the first shared-memory block, unblocks
        # SIGINT and SIGTERM in this thread; the engine core process keeps them blocked.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        try:
            self._ring = ShmRingWriter(num_readers=len(self.ring_ranks), host_doorbells=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if self.ring_ranks[0] == 0:
            replies, bell = self._gather({0: self.actors[0].open_replies.remote()})[0]
            self._replies_bell = HostDoorbell(bell)
            self._replies = ShmRingReader(replies, 0, self._replies_bell)
        for index, rank in enumerate(self.ring_ranks):
            self._readers[rank] = (
                self.actors[rank]
                .serve_ring.options(concurrency_group=RING_GROUP)
                .remote(self._ring.handle, index, self._ring.doorbell_handles[index])
            )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank and return rank 0's output; WorkerError if any fails."""
        return self.submit(scheduler_output).result()

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Send the step to every rank and return; its output is rank 0's answer."""
        step = self._encoder.encode(RunStep(scheduler_output))
        if self._ring is not None:
            self._ring.write(step, on_wait=lambda: self._check({}))
        refs = {
            rank: actor.execute_model.remote(step)
            for rank, actor in enumerate(self.actors)
            if rank not in self._readers
        }
        future = _RayStep(self, refs)
        if self._replies is not None:
            self._pending.append(future)
        return future

    def _result(self, step: _RayStep) -> ModelRunnerOutput:
        """step's output: rank 0's answer, from its call or read from its replies ring (with
        the outputs of the steps before it), once every rank's call has answered."""
        if self._replies is None:
            return self._decoder.decode(self._gather(step.refs)[0])
        while step.output is None:
            self._pending.popleft().output = self._replies.read(
                self._decoder.decode, on_sleep=lambda: self._check(step.refs)
            )
        self._gather(step.refs)
        return step.output

    def _gather_all(self, call: Callable[[ray.actor.ActorHandle], ray.ObjectRef]) -> list:
        """call(actor)'s answer from every rank, in rank order."""
        answers = self._gather({rank: call(actor) for rank, actor in enumerate(self.actors)})
        return [answers[rank] for rank in range(self.world_size)]

    def _gather(self, refs: dict[int, ray.ObjectRef]) -> dict[int, object]:
        """Each rank's answer. The first failure, awaited or not, and the end of any ring
        rank's serve_ring() call (it ends early only by failing) raise WorkerError at once (a
        rank left waiting in a collective for a dead peer never would)."""
        pending = list(refs.values())
        watched = list(self._readers.values())
        while pending:
            ready, _ = ray.wait(pending + watched, num_returns=1)
            if ready[0] not in pending:
                raise self._failure(refs)
            try:
                ray.get(ready)
            except RayError:
                raise self._failure(refs) from None
            pending.remove(ready[0])
        return dict(zip(refs, ray.get(list(refs.values())), strict=True))

    def _check(self, refs: dict[int, ray.ObjectRef]) -> None:
        """WorkerError if a ring rank's thread has ended or a call in refs has failed (checked
        while waiting on a ring: ray.wait cannot wake on shared memory)."""
        watched = list(self._readers.values())
        ready, _ = ray.wait(
            watched + list(refs.values()), num_returns=len(watched) + len(refs), timeout=0
        )
        if any(ref in watched for ref in ready):
            raise self._failure(refs)
        try:
            ray.get(ready)
        except RayError:
            raise self._failure(refs) from None

    def _failure(self, refs: dict[int, ray.ObjectRef]) -> WorkerError:
        """What is known of the failed ranks: the dead ones first, as the likely cause (their
        peers fail in a collective once they are gone), then the errors that ranks raised. A
        ring rank is known by its serve_ring() call."""
        self._failed = True
        refs = dict(sorted({**refs, **self._readers}.items()))
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=FAILURE_GRACE_S)
        dead, raised = [], []
        for rank, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                dead.append(
                    f"engine worker rank {rank} ({self._where(rank)}) died: {death_reason(e)}"
                )
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
        """Stop the ring ranks' threads, ask the actors to leave their group, kill them, free
        the ring and the bundles, disconnect."""
        if self.actors and not self._failed:
            try:
                if self._ring is not None:
                    self._ring.write(self._encoder.encode(Shutdown()), SHUTDOWN_TIMEOUT_S)
                    ray.get(list(self._readers.values()), timeout=SHUTDOWN_TIMEOUT_S)
                ray.get(
                    [actor.shutdown.remote() for actor in self.actors], timeout=SHUTDOWN_TIMEOUT_S
                )
            except (RayError, TimeoutError):
                pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        self._readers = {}
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        if self._replies_bell is not None:
            self._replies_bell.close()
            self._replies_bell = None
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._connected:
            ray.shutdown()
            self._connected = False


class _RayStep:
    """A step sent to every rank; result() waits for all of them, returns rank 0's output."""

    def __init__(self, executor: RayExecutor, refs: dict[int, ray.ObjectRef]) -> None:
        self._executor = executor
        self.refs = refs  # the calls of the ranks that got the step by an actor call
        self.output: ModelRunnerOutput | None = None  # set once read from rank 0's replies ring

    def result(self) -> ModelRunnerOutput:
        return self._executor._result(self)
