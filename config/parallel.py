"""ParallelConfig: tensor and data parallelism, and which backend runs the ranks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from config.errors import ConfigError

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class ParallelConfig:
    """How many devices share the model."""

    tensor_parallel_size: int = 1
    # Mixture-of-experts layers place whole experts on the tensor-parallel ranks (E / TP each)
    # instead of splitting every expert's intermediate dimension; dense layers are unchanged,
    # and with one rank (or a dense model) it changes nothing, as in vLLM.
    enable_expert_parallel: bool = False
    # 'uni': the worker runs in the engine core's process; 'mp': one worker process per rank;
    # 'ray': one Ray actor per rank, on the nodes of a Ray cluster. None picks 'mp' when
    # tensor_parallel_size > 1, else 'uni'.
    distributed_executor_backend: str | None = None
    # Data parallelism (engine serve only): data_parallel_size engine cores in all, of which
    # data_parallel_size_local (default: all) run on this host from data_parallel_start_rank;
    # other hosts' ranks join at data_parallel_address:data_parallel_rpc_port.
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # 'mp': engine serve starts the engine cores as its child processes (other hosts' with
    # --headless); 'ray': each engine core runs in a Ray actor placed on a Ray cluster's nodes.
    data_parallel_backend: str = "mp"
    # Set by engine serve for each engine core it starts; None outside a DP group.
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        backend = self.distributed_executor_backend
        if backend not in (None, *EXECUTOR_BACKENDS):
            raise ConfigError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "distributed_executor_backend 'ray' needs Ray, which is not "
                "installed: pip install ray (the engine's [ray] extra)"
            )
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ConfigError(
                f"data_parallel_backend must be one of "
                f"{', '.join(DATA_PARALLEL_BACKENDS)}, got "
                f"{self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray":
            if importlib.util.find_spec("ray") is None:
                raise ConfigError(
                    "data_parallel_backend 'ray' needs Ray, which is not "
                    "installed: pip install ray (the engine's [ray] extra)"
                )
            if backend == "ray":
                raise ConfigError(
                    "data_parallel_backend 'ray' runs each engine core's "
                    "tensor-parallel ranks on its actor's node (mp); "
                    "distributed_executor_backend 'ray' inside it is not supported"
                )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend 'uni' runs a single worker; tensor_parallel_size "
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )

    @property
    def executor_backend(self) -> str:
        """The resolved backend: 'uni', 'mp' or 'ray'."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"
