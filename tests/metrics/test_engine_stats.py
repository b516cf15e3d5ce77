"""EngineStatsRecorder: gauges, counters and the periodic log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from metrics.engine_stats import EngineStatsRecorder
from protocol.engine_core import SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _value(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": model, "engine": "0"})


def test_gauges_show_last_stats_and_counters_sum() -> None:
    rec = EngineStatsRecorder("engine-gauges")
    rec.record(
        SchedulerStats(
            3,
            5,
            0.25,
            prefix_cache_queries=64,
            prefix_cache_hits=32,
            num_preemptions=1,
            num_prompt_tokens=40,
            num_generation_tokens=3,
        )
    )
    rec.record(
        SchedulerStats(
            2,
            1,
            0.5,
            prefix_cache_queries=16,
            prefix_cache_hits=0,
            num_prompt_tokens=0,
            num_generation_tokens=2,
        )
    )
    assert _value("vllm:num_requests_running", "engine-gauges") == 2
    assert _value("vllm:num_requests_waiting", "engine-gauges") == 1
    assert _value("vllm:kv_cache_usage_perc", "engine-gauges") == 0.5
    rec.flush()  # the second step's per-step series were held (requests still run)
    assert _value("vllm:prefix_cache_queries_total", "engine-gauges") == 80
    assert _value("vllm:prefix_cache_hits_total", "engine-gauges") == 32
    assert _value("vllm:num_preemptions_total", "engine-gauges") == 1
    assert _value("vllm:prompt_tokens_total", "engine-gauges") == 40
    assert _value("vllm:generation_tokens_total", "engine-gauges") == 5
    assert _value("vllm:iteration_tokens_total_count", "engine-gauges") == 2
    assert _value("vllm:iteration_tokens_total_sum", "engine-gauges") == 45


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "metrics.engine_stats"]


def test_logs_every_interval_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rec = EngineStatsRecorder("engine-log", log_interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="metrics.engine_stats")
    for _ in range(11):  # steps at t = 0, 1, ..., 10 s
        rec.record(
            SchedulerStats(
                2,
                1,
                0.125,
                prefix_cache_queries=10,
                prefix_cache_hits=5,
                num_prompt_tokens=100,
                num_generation_tokens=2,
            )
        )
        clock.now += 1.0
    lines = _log_lines(caplog)
    assert lines == [
        "Avg prompt throughput: 110.0 tokens/s, Avg generation throughput: 2.2 "
        "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, "
        "Prefix cache hit rate: 50.0%"
    ]


def test_no_log_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rec = EngineStatsRecorder("engine-idle", log_interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="metrics.engine_stats")
    rec.record(SchedulerStats(1, 0, 0.1, num_generation_tokens=1))
    clock.now += 60.0  # idle: the busy loop does not step, so record() is not called
    rec.record(SchedulerStats(1, 0, 0.1, num_generation_tokens=1))
    clock.now += 1.0
    rec.record(SchedulerStats(1, 0, 0.1, num_generation_tokens=1))
    assert _log_lines(caplog) == []


def test_per_step_series_are_held_while_busy_and_written_when_idle() -> None:
    """Generation and iteration tokens reach Prometheus at most HOLD_S late while requests run,
    and at once on the step that leaves the engine idle; gauges always at once."""
    from metrics.engine_stats import HOLD_S

    clock = FakeClock()
    m = "engine-hold"
    rec = EngineStatsRecorder(m, clock=clock)
    rec.record(SchedulerStats(1, 0, 0.1, num_prompt_tokens=8, num_generation_tokens=1))
    assert _value("vllm:generation_tokens_total", m) == 1  # the first step writes
    for _ in range(5):
        clock.now += HOLD_S / 10
        rec.record(SchedulerStats(1, 0, 0.1, num_generation_tokens=1))
    assert _value("vllm:generation_tokens_total", m) == 1
    assert _value("vllm:iteration_tokens_total_count", m) == 1
    assert _value("vllm:prompt_tokens_total", m) == 8  # prefill counters go straight through
    rec.record(SchedulerStats(2, 1, 0.2, num_generation_tokens=1))
    assert _value("vllm:num_requests_running", m) == 2  # gauges: at once
    assert _value("vllm:num_requests_waiting", m) == 1
    clock.now += HOLD_S
    rec.record(SchedulerStats(2, 1, 0.2, num_generation_tokens=2))
    assert _value("vllm:generation_tokens_total", m) == 1 + 5 + 1 + 2
    assert _value("vllm:iteration_tokens_total_count", m) == 8
    assert _value("vllm:iteration_tokens_total_sum", m) == 8 + 1 + 5 + 1 + 2
    clock.now += HOLD_S / 10
    rec.record(SchedulerStats(1, 0, 0.2, num_generation_tokens=3))
    assert _value("vllm:generation_tokens_total", m) == 9
    rec.record(SchedulerStats(0, 0, 0.0, num_generation_tokens=1))  # the last request ended
    assert _value("vllm:generation_tokens_total", m) == 13
    assert _value("vllm:iteration_tokens_total_count", m) == 10
    assert _value("vllm:num_requests_running", m) == 0
    assert _value("vllm:kv_cache_usage_perc", m) == 0.0
