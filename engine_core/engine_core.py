"""EngineCore: the token-level engine (scheduler + executor), driven one step at a time."""

from __future__ import annotations

import atexit
import gc
import threading
import time
from collections import deque
from dataclasses import dataclass

from config.engine import EngineConfig
from config.errors import ConfigError
from engine_core.log_options import apply_log_options
from engine_core.remote_code import log_remote_code_notice
from engine_core.request import Request, RequestStatus
from engine_core.resolve import resolve_config
from engine_core.scheduler import Scheduler
from engine_core.validation import InvalidRequestError, validate_request
from executor.base import StepFuture
from executor.factory import create_executor
from protocol.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from protocol.step import ModelRunnerOutput, SchedulerOutput

# How long an engine with only compiling grammars to wait for waits at a time (new requests and
# aborts are seen between waits).
_GRAMMAR_WAIT_S = 0.005


@dataclass
class StatTotals:
    """Counters summed over every step since the engine started."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    def add(self, stats: SchedulerStats) -> None:
        """Add one step's counters."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(stats, name))


class EngineCore:
    """Adds, aborts and steps requests; knows token ids only, never text."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        if parallel.data_parallel_size > 1 and parallel.data_parallel_rank is None:
            raise ConfigError(
                f"--data-parallel-size {parallel.data_parallel_size} runs several "
                "engine cores, which only `engine serve` starts; this runs one"
            )
        if config.arch is None:
            resolve_config(config)
        assert config.arch is not None
        self.config = config
        apply_log_options(config.observability)
        log_remote_code_notice(config.model_path, config.model.trust_remote_code)
        self.executor = create_executor(config)
        self.num_blocks = self.executor.initialize()
        eos = config.arch.eos_token_ids[0] if config.arch.eos_token_ids else None
        self.scheduler = Scheduler(config, self.num_blocks, eos)
        self.totals = StatTotals()
        # Async scheduling: steps handed to the executor whose outputs are not applied yet.
        self._in_flight: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        self._structured_lock = threading.Lock()
        # As vLLM: what start-up built (model, tables, modules) stays for the engine's life;
        # frozen, the collector's full passes no longer walk it during the busy loop.
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()

    def _structured_output(self):
        """The structured-output manager, made with the first constrained request (so that an
        engine that never sees one never imports the grammar library)."""
        with self._structured_lock:
            manager = self.scheduler.structured_output
            if manager is None:
                from engine_core.structured_output.manager import StructuredOutputManager

                config = self.config
                assert config.arch is not None
                manager = StructuredOutputManager(
                    config.tokenizer_path,
                    config.arch.vocab_size,
                    list(config.arch.eos_token_ids),
                    config.scheduler.max_num_seqs,
                )
                self.scheduler.structured_output = manager
            return manager

    def make_request(self, request: EngineCoreRequest) -> Request:
        """Validate a request and compute its prefix-cache block hashes.

        Safe to call from another thread (the engine core process's input thread), so hashing
        overlaps the busy loop; raises InvalidRequestError (a ValueError) on bad input.
        """
        validate_request(request, self.config)
        req = Request.from_engine_core_request(
            request, self.scheduler.eos_token_id, self.scheduler.block_hasher
        )
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            try:
                req.grammar = self._structured_output().request_grammar(
                    constraint, request.sampling_params.reasoning_end_token_ids
                )
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
        return req

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request (an EngineCoreRequest goes through make_request first)."""
        if isinstance(request, EngineCoreRequest):
            request = self.make_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests and free their KV blocks now; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or an abort is not yet reported."""
        return self._has_work_to_schedule() or bool(self._in_flight)

    def _has_work_to_schedule(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and apply one step; the outputs of every request that progressed.

        With async scheduling a call schedules and submits the next step, then applies the
        oldest step in flight once two are; the first call of a run only submits (no outputs),
        so the model is never idle while the engine prepares a batch or applies outputs.
        """
        if not self._in_flight and self.scheduler.only_waiting_for_grammars():
            # Nothing to run until a compile ends: wait for it a little, not in a busy spin.
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        if self.scheduler.async_scheduling:
            return self._step_overlapped()
        if not self.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.time())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def _step_overlapped(self) -> EngineCoreOutputs:
        in_flight = self._in_flight
        if len(in_flight) < 2 and self._has_work_to_schedule():
            scheduler_output = self.scheduler.schedule()
            # An empty step still tells the workers which requests ended; skip it only when a
            # step in flight can carry that news instead.
            if (
                scheduler_output.total_num_scheduled_tokens
                or scheduler_output.finished_req_ids
                or not in_flight
            ):
                in_flight.append((scheduler_output, self.executor.submit(scheduler_output)))
                if len(in_flight) == 1 and scheduler_output.total_num_scheduled_tokens:
                    return EngineCoreOutputs(timestamp=time.time())
        if not in_flight:
            return EngineCoreOutputs(timestamp=time.time())
        scheduler_output, future = in_flight.popleft()
        return self._apply(scheduler_output, future.result())

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        stats = self.scheduler.make_stats()
        self.totals.add(stats)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refuses (False) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the workers (after the steps in flight)."""
        if self.scheduler.structured_output is not None:
            self.scheduler.structured_output.shutdown()
        self.executor.shutdown()


_unfreeze_registered = False


def _unfreeze_at_exit() -> None:
    """Hand frozen objects back to the collector when the interpreter exits: the final
    collection never visits the permanent generation, so cycles frozen at start-up (Triton's
    IR objects among them) would outlive their extension modules, and nanobind would print
    dozens of "leaked instance" lines on every exit."""
    global _unfreeze_registered
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
