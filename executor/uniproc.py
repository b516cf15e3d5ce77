"""The single-device executor: one worker in the engine core's own process."""

from __future__ import annotations

from executor.base import Executor
from gpu_worker.protocol import ModelRunnerOutput, SchedulerOutput
from gpu_worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls the worker directly; no IPC."""

    def initialize(self) -> int:
        self.worker = Worker(self.config)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
