"""Two processes write into one multiprocess directory; render_metrics() shows one view."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from metrics.exposition import mark_process_dead, render_metrics, setup_multiprocess_dir

ROOT = Path(__file__).resolve().parents[2]

ENGINE_PROC = """
from protocol.engine_core import SchedulerStats
from metrics.engine_stats import EngineStatsRecorder
from metrics.request_stats import RequestStatsRecorder
rec = EngineStatsRecorder("tiny")
rec.record(SchedulerStats(4, 2, 0.75, prefix_cache_queries=10, prefix_cache_hits=4,
                          num_prompt_tokens=30, num_generation_tokens=4))
rec.record(SchedulerStats(3, 1, 0.5, num_generation_tokens=3))
rec.flush()  # as the engine core does on its way out
req = RequestStatsRecorder("tiny", max_model_len=1024)
req.on_arrival("x", 1.0); req.on_tokens("x", 1, 1.5); req.on_finish("x", "stop", 12, 1.5)
"""

TOKENIZER_PROC = """
from metrics.request_stats import RequestStatsRecorder
req = RequestStatsRecorder("tiny", max_model_len=1024)
for i in range(2):
    req.on_arrival(str(i), 1.0); req.on_tokens(str(i), 1, 1.25); req.on_tokens(str(i), 1, 1.5)
    req.on_finish(str(i), "length", 5, 1.5)
"""


def _run(code: str, metrics_dir: str) -> int:
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT)
    assert proc.wait(timeout=60) == 0
    return proc.pid


def _samples(metrics_dir: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = render_metrics(metrics_dir)
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_one_view_across_processes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics_dir = setup_multiprocess_dir(str(tmp_path / "prom"))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")  # setup exported it for children only
    engine_pid = _run(ENGINE_PROC, metrics_dir)
    _run(TOKENIZER_PROC, metrics_dir)

    s = _samples(metrics_dir)
    model = (("engine", "0"), ("model_name", "tiny"))

    def reason(r: str) -> tuple[tuple[str, str], ...]:  # label pairs in sorted order
        return (model[0], ("finished_reason", r), model[1])

    assert s[("vllm:num_requests_running", model)] == 3
    assert s[("vllm:num_requests_waiting", model)] == 1
    assert s[("vllm:kv_cache_usage_perc", model)] == 0.5
    assert s[("vllm:prompt_tokens_total", model)] == 30
    assert s[("vllm:generation_tokens_total", model)] == 7
    assert s[("vllm:prefix_cache_queries_total", model)] == 10
    assert s[("vllm:prefix_cache_hits_total", model)] == 4
    assert s[("vllm:iteration_tokens_total_count", model)] == 2
    # Request metrics from both processes are summed.
    assert s[("vllm:request_success_total", reason("stop"))] == 1
    assert s[("vllm:request_success_total", reason("length"))] == 2
    assert s[("vllm:time_to_first_token_seconds_count", model)] == 3
    assert s[("vllm:inter_token_latency_seconds_count", model)] == 2
    assert s[("vllm:e2e_request_latency_seconds_sum", model)] == 1.5
    assert s[("vllm:request_prompt_tokens_sum", model)] == 22
    for name in (
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_generation_tokens_count",
    ):
        assert s[(name, model)] == 3

    # Once the launcher reports the engine core dead, its gauges leave the view; counters stay.
    mark_process_dead(engine_pid, metrics_dir)
    s = _samples(metrics_dir)
    assert ("vllm:num_requests_running", model) not in s
    assert s[("vllm:prompt_tokens_total", model)] == 30


def test_setup_clears_an_old_directory(tmp_path: Path, monkeypatch) -> None:
    old = tmp_path / "prom"
    old.mkdir()
    (old / "counter_123.db").write_bytes(b"stale")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unset")
    assert setup_multiprocess_dir(str(old)) == str(old)
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(old)
    assert list(old.iterdir()) == []
