"""Executor: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from config.engine import EngineConfig
from protocol.step import ModelRunnerOutput, SchedulerOutput


class WorkerError(RuntimeError):
    """A worker raised or died; the message names its rank."""


class StepFuture(Protocol):
    """A step handed to the workers; result() waits for its output (or raises its error)."""

    def result(self) -> ModelRunnerOutput: ...


class _Finished:
    """A step that already ran."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


class Executor(ABC):
    """Starts workers, sizes the KV cache across them and runs steps on all of them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def initialize(self) -> int:
        """Load the model everywhere and allocate the KV cache; returns the number of blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the output of rank 0."""

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Start one step and return at once where the executor can (async scheduling); steps
        run in the order submitted. This default runs the step before returning."""
        return _Finished(self.execute_model(scheduler_output))

    def shutdown(self) -> None:  # noqa: B027 (optional: an executor without workers has none)
        """Release workers."""
