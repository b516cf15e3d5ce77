"""The Ray actor behind RayExecutor: one rank's Worker (gpu_worker/worker.py) in a Ray worker
process, driven by actor method calls. Steps and outputs cross as msgspec bytes, never pickles."""

from __future__ import annotations

import fcntl
import os
import socket
import struct

import msgspec
import ray

from engine_core.config import EngineConfig
from executor.ray_cluster import free_tcp_address
from gpu_worker.protocol import SchedulerOutput
from gpu_worker.worker import Worker


class EngineWorker:
    """One tensor-parallel rank. Ray runs one actor's calls one at a time, in the order the
    executor made them, so the steps run in order on every rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Worker | None = None
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._encoder = msgspec.msgpack.Encoder()

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP address, pid) of this actor."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_tcp_address(self) -> str:
        """tcp://<this node's IP>:<a free port>, where the tensor-parallel group meets (rank 0's
        node: rank 0 hosts the rendezvous)."""
        return free_tcp_address()

    def load_model(self, encoded_config: bytes, init_method: str) -> int:
        """Join the tensor-parallel group, load this rank's shard; the KV blocks it can hold."""
        config = msgspec.msgpack.decode(encoded_config, type=EngineConfig)
        # gloo binds to the address the host name resolves to, often 127.0.0.1 (containers),
        # which peers on other nodes cannot reach: use the interface Ray reaches this node on.
        interface = _interface_of(ray.util.get_node_ip_address())
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        self.worker = Worker(config, self.rank, init_method)
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks (the same on every rank) and warm up."""
        assert self.worker is not None, "load_model() first"
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, encoded_step: bytes) -> bytes | None:
        """Run one step; rank 0 returns its ModelRunnerOutput (encoded), the others None."""
        assert self.worker is not None, "load_model() first"
        output = self.worker.execute_model(self._decoder.decode(encoded_step))
        return self._encoder.encode(output) if self.rank == 0 else None

    def shutdown(self) -> None:
        """Leave the tensor-parallel group."""
        if self.worker is not None:
            self.worker.shutdown()


_SIOCGIFADDR = 0x8915


def _interface_of(ip: str) -> str | None:
    """The name of the network interface that holds the IPv4 address ip, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                address = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24]
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(address) == ip:
                return name
    return None
