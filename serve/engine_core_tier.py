"""The first tier `engine serve` starts: this host's engine cores, one per local data-parallel
rank, each answering the launcher's HELLO with READY once its model is loaded."""

from __future__ import annotations

import os
import socket

from config.engine import EngineConfig
from engine_core.core_launcher import CoreProcess
from ipc.handshake import hello_frames
from protocol.engine_core import PROTOCOL_VERSION, ClientHello, output_decoders
from serve.child import Child
from serve.data_parallel_plan import DataParallelPlan
from serve.dp_rendezvous import local_address_towards, tcp_address


def start_engine_cores(
    config: EngineConfig, dp: DataParallelPlan
) -> tuple[list[Child], list[CoreProcess]]:
    """Start this host's engine cores (ranks dp.local, in order); a headless host's listen on
    TCP for the first host, the others on private ipc:// sockets."""
    host = local_address_towards(dp.address) if dp.headless else ""
    # Engine cores of one host share its cores: each gets its part of the threads (as the
    # mp executor splits them among TP ranks), unless the user chose a number.
    env = (
        {}
        if len(dp.local) <= 1 or "OMP_NUM_THREADS" in os.environ
        else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(dp.local)))}
    )
    children, cores = [], []
    for rank in dp.local:
        core = CoreProcess(
            config if dp.size == 1 else config.for_rank(rank),
            own_process_group=True,
            extra_env=env,
            address=tcp_address(host, _free_port(host)) if host else None,
        )
        cores.append(core)
        children.append(
            Child(
                "engine-core" if dp.size == 1 else f"engine-core-{rank}",
                core.popen,
                core.address,
                hello_frames(ClientHello(PROTOCOL_VERSION, "launcher")),
                output_decoders(),
            )
        )
    return children, cores


def _free_port(host: str) -> int:
    """A TCP port that was free on host a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
