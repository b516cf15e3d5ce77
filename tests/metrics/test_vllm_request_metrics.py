"""The metrics vLLM dashboards read beyond latencies: inference time, time per output token,
the n and max_tokens parameters, prompt tokens by source and the cache configuration."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from config.cache import CacheConfig
from metrics.engine_stats import EngineStatsRecorder
from metrics.request_stats import RequestStatsRecorder
from protocol.engine_core import SchedulerStats
from tests.metrics.test_request_stats import _value


def test_inference_time_tpot_and_request_params() -> None:
    m = "vllm-req-params"
    rec = RequestStatsRecorder(m, max_model_len=2048)
    rec.on_request(2)
    rec.on_arrival("a", 100.0, max_tokens=16)
    rec.on_arrival("b", 100.0)
    rec.on_step(100.0)
    rec.on_step(100.5)
    rec.on_tokens("a", 1, 100.5)  # scheduled at 100.0 (the step before)
    rec.on_tokens("a", 1, 100.7)
    rec.on_tokens("a", 2, 101.1)
    rec.on_finish("a", "length", 5, 101.1)
    rec.on_tokens("b", 1, 101.2)
    rec.on_finish("b", "stop", 5, 101.2)
    assert _value("vllm:request_params_n_count", m) == 1
    assert _value("vllm:request_params_n_bucket", m, le="2.0") == 1
    assert _value("vllm:request_params_n_bucket", m, le="1.0") == 0
    assert _value("vllm:request_params_max_tokens_count", m) == 1  # b left it unset
    assert _value("vllm:request_params_max_tokens_sum", m) == 16
    assert _value("vllm:request_inference_time_seconds_count", m) == 2
    # Both scheduled at 100.0 (the step before their first token's): -> 101.1 and -> 101.2.
    assert _value("vllm:request_inference_time_seconds_sum", m) == pytest.approx(1.1 + 1.2)
    # Only a has tokens after its first: (101.1 - 100.5) / 3.
    assert _value("vllm:request_time_per_output_token_seconds_count", m) == 1
    assert _value("vllm:request_time_per_output_token_seconds_sum", m) == pytest.approx(0.2)


def test_prompt_tokens_count_cached_ones_and_by_source() -> None:
    m = "vllm-prompt-sources"
    rec = EngineStatsRecorder(m)
    rec.record(SchedulerStats(1, 0, 0.1, num_prompt_tokens=40, num_cached_prompt_tokens=32))
    rec.record(SchedulerStats(1, 0, 0.1, num_prompt_tokens=10))
    assert _value("vllm:prompt_tokens_total", m) == 50
    assert _value("vllm:prompt_tokens_cached_total", m) == 32
    assert _value("vllm:prompt_tokens_by_source_total", m, source="local_compute") == 18
    assert _value("vllm:prompt_tokens_by_source_total", m, source="local_cache_hit") == 32
    assert _value("vllm:prompt_tokens_by_source_total", m, source="external_kv_transfer") == 0


def test_cache_config_info() -> None:
    rec = EngineStatsRecorder("vllm-cache-info")
    rec.record_cache_config(CacheConfig(block_size=16), 123)
    sample = next(
        s
        for metric in REGISTRY.collect()
        if metric.name == "vllm:cache_config_info"
        for s in metric.samples
    )
    assert sample.value == 1
    assert sample.labels["block_size"] == "16" and sample.labels["num_gpu_blocks"] == "123"
    assert sample.labels["enable_prefix_caching"] == "True" and sample.labels["engine"] == "0"
