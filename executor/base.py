"""Executor: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine_core.config import EngineConfig
from gpu_worker.protocol import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Starts workers, sizes the KV cache across them and runs steps on all of them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def create(config: EngineConfig) -> Executor:
        """One worker process per rank (backend 'mp'), or the worker in this process ('uni')."""
        if config.parallel.executor_backend == "mp":
            from executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(config)
        from executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    @abstractmethod
    def initialize(self) -> int:
        """Load the model everywhere and allocate the KV cache; returns the number of blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the output of rank 0."""

    def shutdown(self) -> None:
        """Release workers."""
