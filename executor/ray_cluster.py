"""Reaching a Ray cluster and reserving one bundle per rank on it, for RayExecutor."""

from __future__ import annotations

import os
import signal
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

PLACEMENT_TIMEOUT_S = 60.0


class RayResourcesError(RuntimeError):
    """The Ray cluster cannot hold the workers; the message says what is missing."""


def connect() -> bool:
    """Join a Ray cluster: the one this process is already connected to, RAY_ADDRESS's, one
    started on this host with `ray start --head`, or else a new local one. True when this call
    connected (the caller then disconnects with ray.shutdown())."""
    if ray.is_initialized():
        return False
    # ray.init() replaces the main thread's SIGTERM handler with sys.exit; the engine core
    # process has its own (a drain), so it is put back. The stop signals are unblocked while
    # Ray starts its processes, which would otherwise inherit the engine core's blocked mask.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        try:
            ray.init(address="auto")  # RAY_ADDRESS, when set, takes the place of "auto"
        except ConnectionError:
            if os.environ.get("RAY_ADDRESS"):
                raise
            ray.init(include_dashboard=False)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main and handler is not None:
            signal.signal(signal.SIGTERM, handler)
    return True


def reserve(world_size: int, resource: str,
            timeout_s: float = PLACEMENT_TIMEOUT_S) -> PlacementGroup:
    """A placement group of world_size bundles of one resource ("CPU" or "GPU") each, packed
    on as few nodes as hold them; RayResourcesError at once when the cluster has too few free,
    or after timeout_s when they cannot be placed."""
    free = ray.available_resources().get(resource, 0.0)
    if free < world_size:
        raise RayResourcesError(_missing(world_size, resource, free))
    group = placement_group([{resource: 1}] * world_size, strategy="PACK")
    if not group.wait(timeout_s):
        remove_placement_group(group)
        free = ray.available_resources().get(resource, 0.0)
        raise RayResourcesError(_missing(world_size, resource, free)
                                + f"; the bundles could not be placed in {timeout_s:g} s")
    return group


def _missing(world_size: int, resource: str, free: float) -> str:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    total = sum(node["Resources"].get(resource, 0.0) for node in nodes)
    per_node = ", ".join(f"node {node['NodeID'][:12]} at {node['NodeManagerAddress']}: "
                         f"{node['Resources'].get(resource, 0.0):g} {resource}"
                         for node in nodes)
    return (f"tensor_parallel_size {world_size} needs {world_size} {resource} bundles (one "
            f"{resource} per rank); the Ray cluster has {free:g} {resource} free of {total:g} "
            f"on {len(nodes)} node(s) ({per_node})")
