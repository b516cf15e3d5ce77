"""Which data-parallel ranks this host runs, read from the --data-parallel-* flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataParallelPlan:
    """Which data-parallel ranks this host runs, from the --data-parallel-* flags."""

    size: int
    local: range
    headless: bool
    address: str
    rpc_port: int
    ray: bool = False  # every rank's engine core in a Ray actor (serve/ray_engine_cores.py)

    @classmethod
    def from_args(cls, engine_args: dict[str, Any], headless: bool) -> DataParallelPlan:
        """The plan, or ValueError naming the flag that does not fit."""
        size = engine_args.get("data_parallel_size", 1)
        start = engine_args.get("data_parallel_start_rank", 0)
        count = engine_args.get("data_parallel_size_local")
        count = size - start if count is None else count
        if size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
        if engine_args.get("data_parallel_backend") == "ray":
            if headless or any(
                f"data_parallel_{name}" in engine_args
                for name in ("size_local", "start_rank", "address", "rpc_port")
            ):
                raise ValueError(
                    "--data-parallel-backend ray places every rank on the Ray "
                    "cluster: --headless and --data-parallel-size-local, "
                    "-start-rank, -address and -rpc-port are for the mp backend"
                )
            return cls(size, range(0), False, "", 0, ray=True)
        if not headless and start != 0:
            raise ValueError(
                "--data-parallel-start-rank is for --headless hosts: the first host "
                "runs ranks 0 to --data-parallel-size-local - 1"
            )
        if not 1 <= count <= size - start or start < 0:
            raise ValueError(
                f"--data-parallel-size-local {count} from --data-parallel-start-rank "
                f"{start} does not fit --data-parallel-size {size} (each host runs at "
                "least one rank)"
            )
        return cls(
            size,
            range(start, start + count),
            headless,
            engine_args.get("data_parallel_address", "127.0.0.1"),
            engine_args.get("data_parallel_rpc_port", 29550),
        )

    @property
    def remote(self) -> range:
        """The ranks other hosts run, as the first host sees them (empty when headless)."""
        return range(0) if self.headless else range(self.local.stop, self.size)
