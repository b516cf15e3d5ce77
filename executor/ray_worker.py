"""The Ray actor behind RayExecutor: one rank's Worker (gpu_worker/worker.py) in a Ray worker
process, driven by actor method calls. Steps and outputs cross as msgspec bytes, never pickles.

A rank on the engine core's host takes its steps from the engine core's shared-memory ring
instead (executor/shm_broadcast.py): serve_ring() reads them on a thread of its own (the actor's
"ring" concurrency group) until the ring says Shutdown; rank 0 writes each step's output into
a ring of its own, which the engine core reads.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

import msgspec
import ray
import torch

from config.engine import EngineConfig
from executor.ray_cluster import free_tcp_address
from executor.shm_broadcast import (
    DoorbellHandle,
    HostDoorbell,
    RingHandle,
    ShmRingReader,
    ShmRingWriter,
)
from executor.worker_messages import Command, RunStep
from gpu_worker.worker import Worker

RING_GROUP = "ring"  # the concurrency group whose one thread runs serve_ring()


class EngineWorker:
    """One tensor-parallel rank. Ray runs one actor's calls one at a time, in the order the
    executor made them, so the steps run in order on every rank; or the steps come in order
    through the ring."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Worker | None = None
        self._decoder = msgspec.msgpack.Decoder(RunStep)
        self._encoder = msgspec.msgpack.Encoder()
        self._ring_steps = 0  # steps run from the ring
        self._replies: ShmRingWriter | None = None  # rank 0's outputs of the ring's steps

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
        """Run one step (an encoded RunStep); rank 0 returns its ModelRunnerOutput (encoded),
        the others None."""
        assert self.worker is not None, "load_model() first"
        output = self.worker.execute_model(self._decoder.decode(encoded_step).scheduler_output)
        return self._encoder.encode(output) if self.rank == 0 else None

    def open_replies(self) -> tuple[RingHandle, DoorbellHandle]:
        """Rank 0, before serve_ring(): make the ring its outputs go back through, with the
        engine core as its one reader; the handles the engine core attaches by."""
        self._replies = ShmRingWriter(num_readers=1, host_doorbells=True)
        return self._replies.handle, self._replies.doorbell_handles[0]

    def serve_ring(self, ring: RingHandle, index: int, doorbell: DoorbellHandle) -> None:
        """Run the steps the engine core writes into its ring, as reader index, until it writes
        Shutdown; rank 0 writes each output into its replies ring. Called once, in the
        RING_GROUP concurrency group: it holds that thread."""
        assert self.worker is not None, "load_model() first"
        if self.worker.device.type == "cuda":
            torch.cuda.set_device(self.worker.device)  # the current device is per thread
        bell = HostDoorbell(doorbell)
        reader = ShmRingReader(ring, index, bell)
        decoder = msgspec.msgpack.Decoder(Command)
        try:
            while isinstance(command := reader.read(decoder.decode), RunStep):
                output = self.worker.execute_model(command.scheduler_output)
                self._ring_steps += 1
                if self._replies is not None:
                    self._replies.write(self._encoder.encode(output))
        finally:
            reader.close()
            bell.close()
            if self._replies is not None:
                self._replies.close()

    def ring_steps(self) -> int:
        """How many steps this rank has run from the ring."""
        return self._ring_steps

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
