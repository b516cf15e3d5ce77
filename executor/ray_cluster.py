"""Reaching a Ray cluster and reserving one bundle per rank on it, for RayExecutor."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

PLACEMENT_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


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
    on as few nodes as hold them. RayResourcesError at once when the whole cluster has too
    few; else after timeout_s if the bundles cannot be placed (others hold the resources, or
    they are split so that no placement fits)."""
    total = ray.cluster_resources().get(resource, 0.0)
    if total < world_size:
        raise RayResourcesError(_missing(world_size, resource))
    free = ray.available_resources().get(resource, 0.0)
    if free < world_size:
        logger.warning("%g %s of the Ray cluster's %g are free, %d needed: waiting up to %g s "
                       "for them", free, resource, total, world_size, timeout_s)
    group = placement_group([{resource: 1}] * world_size, strategy="PACK")
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise RayResourcesError(_missing(world_size, resource)
                                + f"; the bundles could not be placed in {timeout_s:g} s")
    return group


def _missing(world_size: int, resource: str) -> str:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    free = ray.available_resources().get(resource, 0.0)
    total = sum(node["Resources"].get(resource, 0.0) for node in nodes)
    per_node = ", ".join(f"node {node['NodeID'][:12]} at {node['NodeManagerAddress']}: "
                         f"{node['Resources'].get(resource, 0.0):g} {resource}"
                         for node in nodes)
    return (f"tensor_parallel_size {world_size} needs {world_size} {resource} bundles (one "
            f"{resource} per rank); the Ray cluster has {free:g} {resource} free of {total:g} "
            f"on {len(nodes)} node(s) ({per_node})")
