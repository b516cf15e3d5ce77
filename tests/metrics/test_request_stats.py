"""RequestStatsRecorder on a scripted request timeline."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from metrics.request_stats import RequestStatsRecorder


def _value(name: str, model: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": model, "engine": "0", **labels})


def test_scripted_timeline() -> None:
    m = "req-timeline"
    rec = RequestStatsRecorder(m, max_model_len=2048)
    rec.on_step(99.0)
    rec.on_arrival("a", 100.0)
    rec.on_arrival("b", 100.0)
    rec.on_step(100.5)  # a step without a or b: both still waiting
    rec.on_step(101.0)  # the step that prefilled a: it began at about 100.5
    rec.on_tokens("a", 1, 101.0)
    rec.on_step(101.1)
    rec.on_tokens("a", 1, 101.1)
    rec.on_tokens("b", 1, 101.1)
    rec.on_step(101.3)
    rec.on_tokens("a", 2, 101.3)
    rec.on_finish("a", "length", 7, 101.3)
    rec.on_finish("b", "abort", 3000, 101.2)
    rec.on_arrival("c", 102.0)
    rec.on_finish("c", "abort", 5, 102.5)  # aborted before its first token
    assert len(rec) == 0

    assert _value("vllm:request_success_total", m, finished_reason="length") == 1
    assert _value("vllm:request_success_total", m, finished_reason="abort") == 2
    assert _value("vllm:time_to_first_token_seconds_count", m) == 2
    assert _value("vllm:time_to_first_token_seconds_sum", m) == pytest.approx(1.0 + 1.1)
    assert _value("vllm:inter_token_latency_seconds_count", m) == 2
    assert _value("vllm:inter_token_latency_seconds_sum", m) == pytest.approx(0.1 + 0.2)
    assert _value("vllm:e2e_request_latency_seconds_count", m) == 3
    assert _value("vllm:e2e_request_latency_seconds_sum", m) == pytest.approx(1.3 + 1.2 + 0.5)
    # Phases only for requests that produced a token; queue + prefill = TTFT.
    assert _value("vllm:request_queue_time_seconds_count", m) == 2
    assert _value("vllm:request_queue_time_seconds_sum", m) == pytest.approx(0.5 + 1.0)
    assert _value("vllm:request_prefill_time_seconds_sum", m) == pytest.approx(0.5 + 0.1)
    assert _value("vllm:request_decode_time_seconds_sum", m) == pytest.approx(0.3 + 0.0)
    assert _value("vllm:request_generation_tokens_sum", m) == 4 + 1 + 0
    assert _value("vllm:request_generation_tokens_bucket", m, le="1.0") == 2
    assert _value("vllm:request_prompt_tokens_count", m) == 3
    assert _value("vllm:request_prompt_tokens_bucket", m, le="10.0") == 2
    # Buckets reach the max_model_len of the process's first recorder (another test's, maybe):
    # a prompt beyond the largest finite one counts in +Inf only.
    largest = max(
        float(s.labels["le"])
        for f in REGISTRY.collect()
        if f.name == "vllm:request_prompt_tokens"
        for s in f.samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    )
    if largest < 3000:
        assert _value("vllm:request_prompt_tokens_bucket", m, le=str(largest)) == 2
    assert _value("vllm:request_prompt_tokens_bucket", m, le="+Inf") == 3


def test_unknown_requests_are_ignored() -> None:
    rec = RequestStatsRecorder("req-unknown", max_model_len=2048)
    rec.on_tokens("nope", 1, 1.0)
    rec.on_finish("nope", "stop", 1, 2.0)
    assert _value("vllm:request_success_total", "req-unknown", finished_reason="stop") is None


def test_inter_token_latency_is_held_until_hold_s_or_the_request_ends() -> None:
    from metrics.registry import HOLD_S

    m = "req-itl-hold"
    rec = RequestStatsRecorder(m, max_model_len=2048)
    rec.on_arrival("a", 100.0)
    rec.on_tokens("a", 1, 100.0)
    rec.on_tokens("a", 1, 100.1)  # the first gap is written: nothing written before
    assert _value("vllm:inter_token_latency_seconds_count", m) == 1
    for i in range(2, 6):
        rec.on_tokens("a", 1, 100.0 + i / 10)
    assert _value("vllm:inter_token_latency_seconds_count", m) == 1
    rec.on_tokens("a", 1, 100.1 + HOLD_S)  # HOLD_S after the last write
    assert _value("vllm:inter_token_latency_seconds_count", m) == 6
    rec.on_tokens("a", 1, 100.2 + HOLD_S)
    rec.on_finish("a", "length", 3, 100.2 + HOLD_S)
    assert _value("vllm:inter_token_latency_seconds_count", m) == 7
    assert _value("vllm:inter_token_latency_seconds_sum", m) == pytest.approx(1.2 + HOLD_S - 1.0)
