"""Ray test fixtures: a local two-node Ray cluster (one CPU each, or two on the head node) and
the processes of a Ray actor class on this machine. Ray's tests and start-up are slow: a module
shares one cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve.conftest import pid_gone


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on this machine; this process is connected to them."""
    yield from _two_nodes(head_cpus=1)


@pytest.fixture(scope="module")
def cluster_with_two_head_cpus():
    """A head node of two CPUs, where this process is connected, and a node of one CPU."""
    yield from _two_nodes(head_cpus=2)


def _two_nodes(head_cpus: int):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": head_cpus})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of each live process here."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and not pid_gone(int(entry.name)):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                found[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return found


def actor_pids(class_name: str) -> dict[int, int]:
    """pid -> parent pid (its node's raylet) of each live Ray actor of class_name here."""
    prefix = f"ray::{class_name}".encode()
    return {
        pid: ppid for pid, (ppid, cmdline) in process_table().items() if cmdline.startswith(prefix)
    }
