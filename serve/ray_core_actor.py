"""The Ray actor behind `engine serve --data-parallel-backend ray`: it holds one data-parallel
rank's bundle on a Ray node and runs that rank's engine core there, as its child process, on
TCP at the node's address with CurveZMQ (docs/scale-out.md, "Ray: engine cores as actors").

The engine core is the process `engine serve` starts on its own host (engine_core.core_proc),
so its signal handling, its name (engine-core-<rank>) and its death with its parent (here the
actor: an actor that dies takes it along) come with it. Ray sets the actor's devices
(CUDA_VISIBLE_DEVICES) and threads (OMP_NUM_THREADS) from the bundle; the engine core and its
tensor-parallel workers inherit them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from engine_core.client import EngineCoreClient
from engine_core.core_launcher import CoreProcess
from engine_core.resolve import resolved_config
from executor.ray_cluster import free_tcp_address
from ipc.curve import ENV_KEY

# How long one HELLO waits for READY before the actor checks that the engine core still runs.
_READY_POLL_S = 1.0


class EngineCoreActor:
    """One data-parallel rank. Create it with max_concurrency=2: stop() must run while
    wait() blocks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.core: CoreProcess | None = None

    def start(
        self, engine_args: dict[str, Any], auth_key: str, timeout_s: float
    ) -> tuple[str, str, str, int]:
        """Start the engine core on tcp://<this node's IP>:<a free port> and wait until it
        answers READY (the shared secret auth_key guards its socket); (address, node id, node
        IP, engine core pid). RuntimeError when it exits first, TimeoutError after timeout_s."""
        address = free_tcp_address()
        # Resolved on this node: the model directory and the kernels are this node's.
        self.core = CoreProcess(
            resolved_config(**engine_args), address=address, extra_env={ENV_KEY: auth_key}
        )
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.core.exit_code()
            if code is not None:
                raise RuntimeError(
                    f"the engine core exited during start-up with code {code} "
                    f"(its log: the lines prefixed (EngineCoreActor "
                    f"pid={os.getpid()}))"
                )
            try:
                EngineCoreClient(
                    address,
                    startup_timeout=_READY_POLL_S,
                    auth_key=auth_key,
                    client_name=f"ray-actor-{self.rank}",
                ).shutdown()
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the engine core at {address} was not ready within {timeout_s:.0f} s"
                    ) from None
        return (
            address,
            ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
            self.core.pid,
        )

    def wait(self) -> int:
        """Block until the engine core exits; its exit status."""
        assert self.core is not None, "start() first"
        return self.core.popen.wait()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM the engine core (it stops after its current step), SIGKILL it after
        timeout_s."""
        if self.core is not None:
            self.core.terminate(timeout_s)
