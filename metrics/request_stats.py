"""Per-request timelines -> latency and token-count histograms (tokenizer process side).

Phases follow vLLM: queue = arrival -> scheduled, prefill = scheduled -> first token,
decode = first token -> last token. The engine core does not report when it scheduled a request,
so `scheduled` is approximated by the end of the engine step before the one that produced the
request's first token (`on_step`), clamped to [arrival, first token]: exact while this process
sees every step and the prefill fits in one step, otherwise prefill time is underestimated and
queue time overestimated by the same amount (their sum, the TTFT, stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Histogram

from metrics.registry import HOLD_S, request_metrics


@dataclass
class _Series:
    """One engine's labelled histograms (bound once per engine: observed on every token)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    inference: Histogram
    time_per_output_token: Histogram
    params_n: Histogram
    params_max_tokens: Histogram
    held_itl: list[float] = field(default_factory=list)  # observed, not yet written (HOLD_S)


@dataclass
class _Timeline:
    arrival: float
    engine: int
    series: _Series
    max_tokens: int | None = None
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    num_tokens: int = 0


class RequestStatsRecorder:
    """Observes TTFT, inter-token, e2e, queue/prefill/decode times and token counts per request,
    labelled with the engine (data-parallel rank) that served it.

    The inter-token latency, observed on every token, is held and written at most every HOLD_S
    (with several processes each observation writes a memory-mapped file, on the per-token
    path) and whenever a request finishes, before its end is reported."""

    def __init__(self, model_name: str, max_model_len: int = 65536) -> None:
        self._m = request_metrics(max_model_len)
        self._model_name = model_name
        self._series: dict[int, _Series] = {}
        self._requests: dict[str, _Timeline] = {}
        # Per engine: (end of the step before the last, end of the last step).
        self._steps: dict[int, tuple[float, float]] = {}
        self._flushed_at = float("-inf")

    def __len__(self) -> int:
        return len(self._requests)

    def _engine_series(self, engine: int) -> _Series:
        series = self._series.get(engine)
        if series is None:
            m, labels = self._m, (self._model_name, str(engine))
            series = self._series[engine] = _Series(
                m.time_to_first_token.labels(*labels),
                m.inter_token_latency.labels(*labels),
                m.e2e_request_latency.labels(*labels),
                m.request_queue_time.labels(*labels),
                m.request_prefill_time.labels(*labels),
                m.request_decode_time.labels(*labels),
                m.request_prompt_tokens.labels(*labels),
                m.request_generation_tokens.labels(*labels),
                m.request_inference_time.labels(*labels),
                m.request_time_per_output_token.labels(*labels),
                m.request_params_n.labels(*labels),
                m.request_params_max_tokens.labels(*labels),
            )
        return series

    def on_request(self, n: int, engine: int = 0) -> None:
        """A request asking for n completions arrived (vllm:request_params_n)."""
        self._engine_series(engine).params_n.observe(n)

    def on_arrival(
        self, request_id: str, t: float, engine: int = 0, max_tokens: int | None = None
    ) -> None:
        """A request (one engine request: each of n completions counts) arrived at time t and
        went to engine `engine`; max_tokens is its parameter (None: unset)."""
        self._requests[request_id] = _Timeline(t, engine, self._engine_series(engine), max_tokens)

    def on_step(self, engine_timestamp: float, engine: int = 0) -> None:
        """A step's outputs of engine `engine` arrived, stamped with the step's end time."""
        self._steps[engine] = (self._steps.get(engine, (0.0, 0.0))[1], engine_timestamp)

    def on_tokens(self, request_id: str, n_new: int, t: float) -> None:
        """n_new tokens of a request arrived at time t."""
        tl = self._requests.get(request_id)
        if tl is None or n_new <= 0:
            return
        if tl.num_tokens == 0:
            tl.first_token = t
            step_start = self._steps.get(tl.engine, (0.0, 0.0))[0]
            tl.scheduled = min(max(tl.arrival, step_start), t)
            tl.series.ttft.observe(t - tl.arrival)
        else:
            # vLLM observes one latency per output batch: the gap since the previous batch.
            tl.series.held_itl.append(t - tl.last_token)
            if t - self._flushed_at >= HOLD_S:
                self.flush(t)
        tl.last_token = t
        tl.num_tokens += n_new

    def flush(self, t: float) -> None:
        """Write the held inter-token latencies (t: now, on the callers' clock)."""
        self._flushed_at = t
        for series in self._series.values():
            held = series.held_itl
            if held:
                for gap in held:
                    series.itl.observe(gap)
                held.clear()

    def on_finish(self, request_id: str, finish_reason: str, prompt_tokens: int, t: float) -> None:
        """A request ended (stop, length, abort) at time t; observes its whole-life metrics."""
        tl = self._requests.pop(request_id, None)
        if tl is None:
            return
        self.flush(t)
        series = tl.series
        self._m.request_success.labels(self._model_name, str(tl.engine), finish_reason).inc()
        series.e2e.observe(t - tl.arrival)
        series.prompt_tokens.observe(prompt_tokens)
        series.generation_tokens.observe(tl.num_tokens)
        if tl.max_tokens is not None:
            series.params_max_tokens.observe(tl.max_tokens)
        if tl.num_tokens:
            series.queue.observe(tl.scheduled - tl.arrival)
            series.prefill.observe(tl.first_token - tl.scheduled)
            series.decode.observe(tl.last_token - tl.first_token)
            series.inference.observe(tl.last_token - tl.scheduled)
        if tl.num_tokens > 1:  # vLLM's mean time per output token after the first
            series.time_per_output_token.observe(
                (tl.last_token - tl.first_token) / (tl.num_tokens - 1)
            )
