"""Speculative decoding's vllm:spec_decode_* counters, from a stream of SchedulerStats: values
and labels through the registry, the multiprocess view, LLM.get_metrics()'s Vector, and the
periodic log line in vLLM's words."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from metrics.engine_stats import EngineStatsRecorder
from metrics.exposition import render_metrics
from metrics.reader import Counter, Vector, get_metrics_snapshot
from protocol.engine_core import SchedulerStats, SpecDecodingStats

ROOT = Path(__file__).resolve().parents[2]

# Three steps of two requests with k = 3: (drafts, draft tokens, accepted, per position).
STEPS = [
    SpecDecodingStats(2, 6, 4, [2, 1, 1]),
    SpecDecodingStats(1, 3, 0, [0, 0, 0]),
    SpecDecodingStats(2, 5, 3, [2, 1]),  # a draft shorter than k: later positions not counted
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stats(spec: SpecDecodingStats | None, running: int = 2) -> SchedulerStats:
    return SchedulerStats(running, 0, 0.1, num_generation_tokens=3, spec_decoding=spec)


def _value(name: str, model: str, engine: str = "0", **extra: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": model, "engine": engine, **extra})


def test_counters_sum_the_steps_with_vllm_labels() -> None:
    m = "spec-counters"
    rec = EngineStatsRecorder(m, engine=1, num_speculative_tokens=3)
    for spec in [*STEPS, None]:  # a step without drafts (a prefill) counts nothing
        rec.record(_stats(spec))
    rec.flush()
    assert _value("vllm:spec_decode_num_drafts_total", m, "1") == 5
    assert _value("vllm:spec_decode_num_draft_tokens_total", m, "1") == 14
    assert _value("vllm:spec_decode_num_accepted_tokens_total", m, "1") == 7
    per_pos = [
        _value("vllm:spec_decode_num_accepted_tokens_per_pos_total", m, "1", position=str(j))
        for j in range(3)
    ]
    assert per_pos == [4, 2, 1]
    assert sum(per_pos) == 7  # accepted tokens are prefixes of the drafts


def test_per_position_series_exist_at_zero_before_any_draft() -> None:
    m = "spec-zero"
    EngineStatsRecorder(m, num_speculative_tokens=2)
    for j in range(2):
        assert _value("vllm:spec_decode_num_accepted_tokens_per_pos_total", m, position=str(j)) == 0
    assert _value("vllm:spec_decode_num_drafts_total", m) == 0


def test_held_while_busy_written_when_idle() -> None:
    from metrics.registry import HOLD_S

    clock = FakeClock()
    m = "spec-hold"
    rec = EngineStatsRecorder(m, clock=clock, num_speculative_tokens=3)
    rec.record(_stats(STEPS[0]))  # the first step writes
    clock.now += HOLD_S / 4
    rec.record(_stats(STEPS[1]))
    assert _value("vllm:spec_decode_num_drafts_total", m) == 2
    clock.now += HOLD_S / 4
    rec.record(_stats(STEPS[2], running=0))  # leaves the engine idle: written at once
    assert _value("vllm:spec_decode_num_drafts_total", m) == 5
    assert _value("vllm:spec_decode_num_accepted_tokens_total", m) == 7


def test_more_positions_than_k_is_an_error() -> None:
    rec = EngineStatsRecorder("spec-too-long", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="3 draft positions"):
        rec.record(_stats(SpecDecodingStats(1, 3, 3, [1, 1, 1])))


def test_get_metrics_folds_positions_into_a_vector() -> None:
    m = "spec-vector"
    rec = EngineStatsRecorder(m, num_speculative_tokens=3)
    for spec in STEPS:
        rec.record(_stats(spec))
    rec.flush()
    mine = [x for x in get_metrics_snapshot() if x.labels.get("model_name") == m]
    by_name = {x.name: x for x in mine}
    vector = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(vector, Vector)
    assert vector.values == [4, 2, 1]
    assert vector.labels == {"model_name": m, "engine": "0"}
    drafts = by_name["vllm:spec_decode_num_drafts"]
    assert isinstance(drafts, Counter) and drafts.value == 5
    # vLLM's compute_acceptance_len: 1 + accepted / drafts.
    accepted = by_name["vllm:spec_decode_num_accepted_tokens"]
    assert isinstance(accepted, Counter)
    assert 1 + accepted.value / drafts.value == pytest.approx(2.4)


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "metrics.engine_stats"]


def test_log_line_in_vllm_words(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rec = EngineStatsRecorder(
        "spec-log", log_interval_s=10.0, clock=clock, num_speculative_tokens=3
    )
    caplog.set_level(logging.INFO, logger="metrics.engine_stats")
    for i in range(11):  # steps at t = 0 .. 10 s; the window closes at 10 s
        rec.record(_stats(STEPS[i % 3]))
        clock.now += 1.0
    lines = _log_lines(caplog)
    assert len(lines) == 2
    assert lines[0].startswith("Avg prompt throughput:")
    # 11 steps: STEPS[0] and STEPS[1] four times, STEPS[2] three times: 18 drafts, 51 draft
    # tokens, 25 accepted, per position [14, 7, 4] / 18, over 10 s.
    assert lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.39, Accepted throughput: 2.50 "
        "tokens/s, Drafted throughput: 5.10 tokens/s, Accepted: 25 tokens, Drafted: 51 "
        "tokens, Per-position acceptance rate: 0.778, 0.389, 0.222, Avg Draft acceptance "
        "rate: 49.0%"
    )


def test_no_spec_line_without_drafts(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rec = EngineStatsRecorder(
        "spec-quiet", log_interval_s=10.0, clock=clock, num_speculative_tokens=2
    )
    caplog.set_level(logging.INFO, logger="metrics.engine_stats")
    for _ in range(11):
        rec.record(_stats(None))
        clock.now += 1.0
    lines = _log_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("Avg prompt throughput:")


ENGINE_PROC = """
import sys
from protocol.engine_core import SchedulerStats, SpecDecodingStats
from metrics.engine_stats import EngineStatsRecorder
k = int(sys.argv[1])
rec = EngineStatsRecorder("tiny", num_speculative_tokens=k)
spec = SpecDecodingStats(1, 2, 1, [1, 0]) if k else None
rec.record(SchedulerStats(1, 0, 0.1, num_generation_tokens=2, spec_decoding=spec))
rec.record(SchedulerStats(0, 0, 0.1, num_generation_tokens=2, spec_decoding=spec))
"""


def _engine_core_metrics(tmp_path: Path, k: int) -> tuple[str, dict[tuple[str, tuple], float]]:
    metrics_dir = tmp_path / f"k{k}"
    metrics_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", ENGINE_PROC, str(k)], env=env, cwd=ROOT, check=True)
    body, _ = render_metrics(str(metrics_dir))
    return str(metrics_dir), {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_registered_only_with_a_speculative_config(tmp_path: Path) -> None:
    """In an engine core process (multiprocess files, as `engine serve` reads them): the
    counters with k > 0, and no vllm:spec_decode_* series at all without speculation; the
    page's live view reads the same numbers, and None where the counters are missing."""
    from frontend.ui.stats import snapshot

    labels = (("engine", "0"), ("model_name", "tiny"))
    on_dir, on = _engine_core_metrics(tmp_path, 2)
    assert on[("vllm:spec_decode_num_drafts_total", labels)] == 2
    assert on[("vllm:spec_decode_num_draft_tokens_total", labels)] == 4
    assert on[("vllm:spec_decode_num_accepted_tokens_total", labels)] == 2
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert on[(per_pos, (labels[0], labels[1], ("position", "0")))] == 2
    assert on[(per_pos, (labels[0], labels[1], ("position", "1")))] == 0
    view = snapshot(on_dir)
    assert (view["spec_drafts"], view["spec_draft_tokens"], view["spec_accepted_tokens"]) == (
        2,
        4,
        2,
    )
    off_dir, off = _engine_core_metrics(tmp_path, 0)
    assert ("vllm:generation_tokens_total", labels) in off
    assert not [name for name, _ in off if name.startswith("vllm:spec_decode")]
    view = snapshot(off_dir)
    assert view["generation_tokens"] == 4
    assert view["spec_drafts"] is view["spec_draft_tokens"] is view["spec_accepted_tokens"] is None


def test_served_repetitive_prompt_counts_accepted_tokens() -> None:
    """`engine serve` of the default model with n-gram: a prompt that repeats itself, greedy;
    /metrics counts drafts and accepted tokens, and the page's live view reads the same."""
    import json
    import urllib.request

    from config.default_model import resolve_model_path
    from tests.serve.conftest import Server

    try:
        resolve_model_path(None)
    except Exception as e:  # the default model's package is not installed
        pytest.skip(str(e))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    args = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    server = Server([*args, "--served-model-name", "m", "--speculative-config", spec])
    assert server.ready, server.stderr
    try:
        body = json.dumps(
            {
                "model": "m",
                "prompt": "red, green, blue, yellow, " * 12,
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        request = urllib.request.Request(
            server.api_url + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 48
        with urllib.request.urlopen(server.api_url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(server.api_url + "/ui/api/stats", timeout=30) as resp:
            view = json.loads(resp.read())["metrics"]
        page = _page_figures(server.api_url)
    finally:
        assert server.stop() == 0, server.stderr
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name") == "m" and s.labels.get("engine") == "0"
    }
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    drafted = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [
        samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(3)
    ]
    assert 0 < accepted <= drafted <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert samples[("vllm:generation_tokens_total", None)] == 48
    assert view["spec_accepted_tokens"] == accepted and view["spec_draft_tokens"] == drafted
    if page is not None:  # the live view in headless Chromium, where it is installed
        assert page["now"]["vllm:spec_decode_num_accepted_tokens_total"] == accepted
        assert page["now"]["vllm:spec_decode_num_draft_tokens_total"] == drafted
        assert page["now"]["vllm:spec_decode_num_drafts_total"] == drafts
        assert f"all time {page['rate']} %" in page["chart"], page["chart"]
        rate = float(page["rate"])
        assert rate == pytest.approx(100 * accepted / drafted, abs=0.051)


def _page_figures(url: str) -> dict | None:
    """The page's Now numbers and acceptance chart text once it shows the chart; None where
    Chromium or playwright is missing."""
    import importlib.util
    import re
    import shutil

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium) or importlib.util.find_spec("playwright") is None:
        return None
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_selector("#chart-spec:not([hidden])", timeout=20_000)
            cells = page.locator("#now td[data-metric^='vllm:spec_decode']")
            cells.first.wait_for(timeout=10_000)
            now = {
                cells.nth(i).get_attribute("data-metric"): float(
                    cells.nth(i).get_attribute("data-value")
                )
                for i in range(cells.count())
            }
            chart = page.inner_text("#chart-spec .value")
        finally:
            browser.close()
    match = re.search(r"all time ([0-9.]+) %", chart)
    return {"now": now, "chart": chart, "rate": match.group(1) if match else None}
