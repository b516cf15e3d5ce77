"""Reaching a Ray cluster and reserving bundles on it: one per tensor-parallel rank for
RayExecutor, one per data-parallel engine core for `--data-parallel-backend ray`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

import ray
from ray.exceptions import RayError
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


def free_tcp_address() -> str:
    """tcp://<this node's IP, as Ray reaches it>:<a port free there a moment ago>."""
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def reserve(
    world_size: int,
    resource: str,
    timeout_s: float = PLACEMENT_TIMEOUT_S,
    *,
    per_bundle: int = 1,
    strategy: str = "PACK",
    need: str | None = None,
) -> PlacementGroup:
    """A placement group of world_size bundles of per_bundle `resource` ("CPU" or "GPU") each,
    placed by strategy (PACK: on as few nodes as hold them; SPREAD: over as many as can).
    RayResourcesError at once when the whole cluster has too few, or no node holds a bundle;
    else after timeout_s if the bundles cannot be placed (others hold the resources, or they
    are split so that no placement fits). need: what the message says is needed (default: the
    tensor-parallel ranks')."""
    need = need or (
        f"tensor_parallel_size {world_size} needs {world_size} {resource} bundles "
        f"(one {resource} per rank)"
    )
    per_node = [node["Resources"].get(resource, 0.0) for node in ray.nodes() if node.get("Alive")]
    total = ray.cluster_resources().get(resource, 0.0)
    if total < world_size * per_bundle or max(per_node, default=0.0) < per_bundle:
        raise RayResourcesError(_missing(need, resource))
    free = ray.available_resources().get(resource, 0.0)
    if free < world_size * per_bundle:
        logger.warning(
            "%g %s of the Ray cluster's %g are free, %d needed: waiting up to %g s for them",
            free,
            resource,
            total,
            world_size * per_bundle,
            timeout_s,
        )
    group = placement_group([{resource: per_bundle}] * world_size, strategy=strategy)
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise RayResourcesError(
            _missing(need, resource) + f"; the bundles could not be placed in {timeout_s:g} s"
        )
    return group


def _missing(need: str, resource: str) -> str:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    free = ray.available_resources().get(resource, 0.0)
    total = sum(node["Resources"].get(resource, 0.0) for node in nodes)
    per_node = ", ".join(
        f"node {node['NodeID'][:12]} at {node['NodeManagerAddress']}: "
        f"{node['Resources'].get(resource, 0.0):g} {resource}"
        for node in nodes
    )
    return (
        f"{need}; the Ray cluster has {free:g} {resource} free of {total:g} on "
        f"{len(nodes)} node(s) ({per_node})"
    )


def death_reason(error: RayError) -> str:
    """Ray's reason for an actor's death: the first sentence of its "The actor is dead
    because ..." line (killed by ray.kill, its process died, its node died)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    why = next(
        (line for line in lines if line.startswith("The actor is dead")),
        lines[-1] if lines else type(error).__name__,
    )
    return why.split(". ")[0].rstrip(".")
