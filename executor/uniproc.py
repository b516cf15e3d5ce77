"""The single-device executor: one worker in the engine core's own process."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from executor.base import Executor, StepFuture
from gpu_worker.async_output import AsyncOutput, ReadyOutput
from gpu_worker.worker import Worker
from protocol.step import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Calls the worker directly; no IPC. Submitted steps run on one model thread, in order,
    while the caller schedules the next (torch ops and the C kernels release the GIL)."""

    _model_thread: ThreadPoolExecutor | None = None

    def initialize(self) -> int:
        self.worker = Worker(self.config)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-model")
        return _LaunchedStep(
            self._model_thread.submit(self.worker.execute_model_async, scheduler_output)
        )

    def shutdown(self) -> None:
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
            self._model_thread = None


class _LaunchedStep:
    """A step the model thread launches; result() waits for the launch, then for its copy."""

    def __init__(self, launch: Future[AsyncOutput | ReadyOutput]) -> None:
        self._launch = launch

    def result(self) -> ModelRunnerOutput:
        return self._launch.result().get_output()
