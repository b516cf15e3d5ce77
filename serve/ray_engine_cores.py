"""`engine serve --data-parallel-backend ray`: every data-parallel rank's engine core in a Ray
actor (serve/ray_core_actor.py), placed by one placement group of one bundle per rank, spread
over the Ray cluster's nodes.

To the launcher these ranks are what headless hosts' ranks are to the first host
(serve/dp_rendezvous.FirstHost, whose interface this class has): each registers its address
once its engine core is READY, the tokenizer processes connect to them over TCP, and a rank
that dies (its engine core exits, or its actor or node is lost) raises RendezvousError naming
it, which stops the whole tree.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from executor.ray_cluster import RayResourcesError, connect, death_reason, reserve
from ipc.curve import ENV_KEY, key_from_env
from serve.dp_rendezvous import RendezvousError
from serve.ray_core_actor import EngineCoreActor

# How long an engine core may take to stop after SIGTERM (it stops after its current step).
_STOP_TIMEOUT_S = 10.0


class RayEngineCores:
    """Ranks 0..size-1 as Ray actors: connects to the cluster, reserves the bundles and starts
    the actors at once (RendezvousError when the cluster is unreachable or too small)."""

    def __init__(self, engine_args: dict[str, Any], size: int, startup_timeout_s: float) -> None:
        self.size = size
        self.addresses: dict[int, str] = {}  # rank -> engine core address, once READY
        try:
            self._connected = connect()
        except ConnectionError as e:
            raise RendezvousError(f"cannot reach the Ray cluster: {e}") from None
        self.address = f"the Ray cluster at {ray.get_runtime_context().gcs_address}"
        # The engine cores listen on TCP: only holders of the secret may talk to them. Without
        # one given, a fresh one; the tokenizer processes inherit it from this process.
        key = key_from_env() or secrets.token_urlsafe(32)
        os.environ[ENV_KEY] = key
        tp = engine_args.get("tensor_parallel_size", 1)
        device = engine_args.get("device", "auto")
        resource = (
            "GPU"
            if device == "cuda"
            or (device == "auto" and ray.cluster_resources().get("GPU", 0.0) > 0)
            else "CPU"
        )
        self._actors: list[ray.actor.ActorHandle] = []
        self._where: dict[int, str] = {}  # rank -> "pid P on node N at IP", once started
        self._starting: dict[ray.ObjectRef, int] = {}
        self._watching: dict[ray.ObjectRef, int] = {}
        self._stopped = False
        self._group = None
        try:
            self._group = reserve(
                size,
                resource,
                per_bundle=tp,
                strategy="SPREAD",
                need=f"data_parallel_size {size} with tensor_parallel_size {tp} needs {size} "
                f"bundles of {tp} {resource} (one per engine core, one {resource} per "
                "tensor-parallel rank)",
            )
        except RayResourcesError as e:
            self.stop(failed=True)
            raise RendezvousError(str(e)) from None
        actor_class = ray.remote(EngineCoreActor)
        for rank in range(size):
            actor = actor_class.options(
                num_cpus=tp if resource == "CPU" else 0,
                num_gpus=tp if resource == "GPU" else 0,
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                ),
            ).remote(rank)
            self._actors.append(actor)
            args = engine_args if size == 1 else {**engine_args, "data_parallel_rank": rank}
            self._starting[actor.start.remote(args, key, startup_timeout_s)] = rank

    def missing(self) -> list[int]:
        """Ranks whose engine core is not READY yet."""
        return [rank for rank in range(self.size) if rank not in self.addresses]

    def poll(self, timeout_s: float) -> None:
        """Note the engine cores that became READY within timeout_s; RendezvousError naming a
        rank whose engine core failed to start or exited, or whose actor died."""
        refs = [*self._starting, *self._watching]
        if not refs or not ray.wait(refs, num_returns=1, timeout=timeout_s)[0]:
            return
        for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            if ref in self._starting:
                self._started(self._starting.pop(ref), ref)
            else:
                self._exited(self._watching.pop(ref), ref)

    def _started(self, rank: int, ref: ray.ObjectRef) -> None:
        try:
            address, node_id, ip, pid = ray.get(ref)
        except RayError as e:
            raise RendezvousError(
                f"{self._name(rank)} (Ray actor) did not start: {_reason(e)}"
            ) from None
        self.addresses[rank] = address
        self._where[rank] = f"pid {pid} on node {node_id[:12]} at {ip}"
        self._watching[self._actors[rank].wait.remote()] = rank

    def _exited(self, rank: int, ref: ray.ObjectRef) -> None:
        try:
            code = ray.get(ref)
        except RayError as e:
            raise RendezvousError(
                f"{self._name(rank)} ({self._where[rank]}): its Ray actor died: {_reason(e)}"
            ) from None
        raise RendezvousError(
            f"{self._name(rank)} ({self._where[rank]}, in a Ray actor) exited "
            f"unexpectedly with code {code}"
        )

    def _name(self, rank: int) -> str:
        return "engine-core" if self.size == 1 else f"engine-core-{rank}"

    def stop(self, failed: bool) -> None:
        """Stop the engine cores, then their actors; free the bundles; disconnect (once)."""
        if self._stopped:
            return
        self._stopped = True
        if self._actors:
            ray.wait(
                [actor.stop.remote(_STOP_TIMEOUT_S) for actor in self._actors],
                num_returns=len(self._actors),
                timeout=_STOP_TIMEOUT_S + 5,
            )
        for actor in self._actors:
            ray.kill(actor)
        if self._group is not None:
            remove_placement_group(self._group)
        if self._connected:
            ray.shutdown()


def _reason(error: RayError) -> str:
    """Why an actor call failed: the actor's death, or what the method raised."""
    if isinstance(error, RayActorError):
        return death_reason(error)
    cause = getattr(error, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
