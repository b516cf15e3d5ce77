"""Per-request timelines -> latency and token-count histograms (tokenizer process side).

Phases follow vLLM: queue = arrival -> scheduled, prefill = scheduled -> first token,
decode = first token -> last token. The engine core does not report when it scheduled a request,
so `scheduled` is approximated by the end of the engine step before the one that produced the
request's first token (`on_step`), clamped to [arrival, first token]: exact while this process
sees every step and the prefill fits in one step, otherwise prefill time is underestimated and
queue time overestimated by the same amount (their sum, the TTFT, stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from metrics.registry import request_metrics


@dataclass
class _Timeline:
    arrival: float
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    num_tokens: int = 0


class RequestStatsRecorder:
    """Observes TTFT, inter-token, e2e, queue/prefill/decode times and token counts per request."""

    def __init__(self, model_name: str, max_model_len: int = 65536) -> None:
        m = request_metrics(max_model_len)
        self._model_name = model_name
        self._success = m.request_success
        self._ttft = m.time_to_first_token.labels(model_name)
        self._itl = m.inter_token_latency.labels(model_name)
        self._e2e = m.e2e_request_latency.labels(model_name)
        self._queue = m.request_queue_time.labels(model_name)
        self._prefill = m.request_prefill_time.labels(model_name)
        self._decode = m.request_decode_time.labels(model_name)
        self._prompt_tokens = m.request_prompt_tokens.labels(model_name)
        self._generation_tokens = m.request_generation_tokens.labels(model_name)
        self._requests: dict[str, _Timeline] = {}
        self._step_start = 0.0
        self._step_end = 0.0

    def __len__(self) -> int:
        return len(self._requests)

    def on_arrival(self, request_id: str, t: float) -> None:
        """A request (one engine request: each of n completions counts) arrived at time t."""
        self._requests[request_id] = _Timeline(t)

    def on_step(self, engine_timestamp: float) -> None:
        """An engine step's outputs arrived, stamped with the step's end time."""
        self._step_start, self._step_end = self._step_end, engine_timestamp

    def on_tokens(self, request_id: str, n_new: int, t: float) -> None:
        """n_new tokens of a request arrived at time t."""
        tl = self._requests.get(request_id)
        if tl is None or n_new <= 0:
            return
        if tl.num_tokens == 0:
            tl.first_token = t
            tl.scheduled = min(max(tl.arrival, self._step_start), t)
            self._ttft.observe(t - tl.arrival)
        else:
            # vLLM observes one latency per output batch: the gap since the previous batch.
            self._itl.observe(t - tl.last_token)
        tl.last_token = t
        tl.num_tokens += n_new

    def on_finish(self, request_id: str, finish_reason: str, prompt_tokens: int,
                  t: float) -> None:
        """A request ended (stop, length, abort) at time t; observes its whole-life metrics."""
        tl = self._requests.pop(request_id, None)
        if tl is None:
            return
        self._success.labels(self._model_name, finish_reason).inc()
        self._e2e.observe(t - tl.arrival)
        self._prompt_tokens.observe(prompt_tokens)
        self._generation_tokens.observe(tl.num_tokens)
        if tl.num_tokens:
            self._queue.observe(tl.scheduled - tl.arrival)
            self._prefill.observe(tl.first_token - tl.scheduled)
            self._decode.observe(tl.last_token - tl.first_token)
