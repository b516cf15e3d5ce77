"""The metrics of the offline LLM class, recorded in its own process from what the engine core
sends it (per-step SchedulerStats and each request's outputs), so LLM.get_metrics() reads the
same vllm: names /metrics serves."""

from __future__ import annotations

import time

from metrics.engine_stats import EngineStatsRecorder
from metrics.request_stats import RequestStatsRecorder
from protocol.engine_core import EngineCoreOutputs
from protocol.sampling_params import SamplingParams


class OfflineStatsRecorder:
    """Engine and request metrics of one LLM; no periodic log line (vLLM's LLM logs none)."""

    def __init__(
        self, model_name: str, max_model_len: int, num_speculative_tokens: int = 0
    ) -> None:
        self.engine = EngineStatsRecorder(
            model_name,
            log_interval_s=float("inf"),
            num_speculative_tokens=num_speculative_tokens,
        )
        self.requests = RequestStatsRecorder(model_name, max_model_len)
        self._prompt_len: dict[str, int] = {}

    def on_request(self, child_ids: list[str], params: SamplingParams, prompt_len: int) -> None:
        """A request of len(child_ids) completions was sent."""
        now = time.time()
        self.requests.on_request(params.n)
        for child_id in child_ids:
            self.requests.on_arrival(child_id, now, max_tokens=params.max_tokens)
            self._prompt_len[child_id] = prompt_len

    def on_step(self, step: EngineCoreOutputs, stopped: list[str]) -> None:
        """One step's outputs; stopped: children a stop string ended (aborted in the engine)."""
        now = time.time()
        if step.scheduler_stats is not None:
            self.engine.record(step.scheduler_stats)
        self.requests.on_step(step.timestamp or now)
        for out in step.outputs:
            self.requests.on_tokens(out.request_id, len(out.new_token_ids), now)
            if out.finished:
                self._finish(out.request_id, str(out.finish_reason), now)
        for child_id in stopped:
            self._finish(child_id, "stop", now)

    def on_abort(self, child_ids: list[str]) -> None:
        now = time.time()
        for child_id in child_ids:
            self._finish(child_id, "abort", now)

    def _finish(self, child_id: str, reason: str, now: float) -> None:
        prompt_len = self._prompt_len.pop(child_id, None)
        if prompt_len is not None:
            self.requests.on_finish(child_id, reason, prompt_len, now)
