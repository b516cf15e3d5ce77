"""The executor a configuration asks for (vLLM's --distributed-executor-backend)."""

from __future__ import annotations

from config.engine import EngineConfig
from executor.base import Executor


def create_executor(config: EngineConfig) -> Executor:
    """One worker process per rank (backend 'mp'), one Ray actor per rank ('ray'), or the
    worker in this process ('uni'). Ray and the worker processes' modules load only when asked
    for."""
    if config.parallel.executor_backend == "mp":
        from executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if config.parallel.executor_backend == "ray":
        from executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
