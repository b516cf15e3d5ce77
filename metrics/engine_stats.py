"""Per-step SchedulerStats -> Prometheus metrics and a periodic throughput log line."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from config.cache import CacheConfig
from metrics.registry import HOLD_S, PROMPT_TOKEN_SOURCES, cache_config_info, engine_metrics
from metrics.spec_decode_stats import SpecDecodeRecorder
from protocol.engine_core import SchedulerStats

logger = logging.getLogger("metrics.engine_stats")


class EngineStatsRecorder:
    """Records one engine core's SchedulerStats every step; logs throughput every interval.

    record() runs on the engine core's critical path between two steps, and with several
    processes (PROMETHEUS_MULTIPROC_DIR) every metric update writes a memory-mapped file: about
    19 us a step in a warm loop, 31 us with the caches flushed, the state after each forward.
    So the gauges are written when they change, and the two series that change every step
    (generation tokens, iteration tokens) are summed here and written at most every HOLD_S
    while requests run, and at once when the step leaves none running or waiting (before that
    step's outputs go out: a client that saw its request end reads the final counts). The
    prompt and prefix-cache counters, written only on steps that prefill, go straight through.
    With num_speculative_tokens > 0 (--speculative-config) the vllm:spec_decode_* counters are
    registered too, held like the generation tokens, and logged after the throughput line.
    """

    def __init__(
        self,
        model_name: str,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        engine: int = 0,
        num_speculative_tokens: int = 0,
    ) -> None:
        m = engine_metrics()
        # Labelled children are bound once: record() runs every step.
        labels = (model_name, str(engine))
        self._running = m.num_requests_running.labels(*labels)
        self._waiting = m.num_requests_waiting.labels(*labels)
        self._kv_usage = m.kv_cache_usage_perc.labels(*labels)
        self._queries = m.prefix_cache_queries.labels(*labels)
        self._hits = m.prefix_cache_hits.labels(*labels)
        self._preemptions = m.num_preemptions.labels(*labels)
        self._prompt = m.prompt_tokens.labels(*labels)
        self._generation = m.generation_tokens.labels(*labels)
        self._iteration = m.iteration_tokens.labels(*labels)
        self._cached = m.prompt_tokens_cached.labels(*labels)
        self._by_source = {
            s: m.prompt_tokens_by_source.labels(*labels, s) for s in PROMPT_TOKEN_SOURCES
        }
        self._spec = (
            SpecDecodeRecorder(labels, num_speculative_tokens) if num_speculative_tokens else None
        )
        self._engine = str(engine)
        self._interval = log_interval_s
        self._clock = clock
        self._window_start = self._last_record = float("-inf")
        self._window = [0, 0, 0, 0]  # prompt tokens, generation tokens, queries, hits
        self._gauges: tuple[int, int, float] | None = None  # last written
        self._held_generation = 0
        self._held_iteration: list[int] = []
        self._flushed_at = float("-inf")

    def record(self, stats: SchedulerStats) -> None:
        """Record one step's stats; call once per engine step."""
        gauges = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
        if gauges != self._gauges:
            old = self._gauges or (None, None, None)
            if gauges[0] != old[0]:
                self._running.set(gauges[0])
            if gauges[1] != old[1]:
                self._waiting.set(gauges[1])
            if gauges[2] != old[2]:
                self._kv_usage.set(gauges[2])
            self._gauges = gauges
        if stats.prefix_cache_queries:
            self._queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self._hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self._prompt.inc(stats.num_prompt_tokens)
            cached = stats.num_cached_prompt_tokens
            self._cached.inc(cached)
            self._by_source["local_compute"].inc(stats.num_prompt_tokens - cached)
            self._by_source["local_cache_hit"].inc(cached)
        if stats.spec_decoding is not None and self._spec is not None:
            self._spec.record(stats.spec_decoding)
        self._held_generation += stats.num_generation_tokens
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens:
            self._held_iteration.append(step_tokens)
        now = self._clock()
        if now - self._flushed_at >= HOLD_S or not (gauges[0] or gauges[1]):
            self.flush(now)
        self._log_if_due(stats, now)

    def flush(self, now: float | None = None) -> None:
        """Write what record() holds to Prometheus."""
        self._flushed_at = self._clock() if now is None else now
        if self._held_generation:
            self._generation.inc(self._held_generation)
            self._held_generation = 0
        if self._held_iteration:
            for tokens in self._held_iteration:
                self._iteration.observe(tokens)
            self._held_iteration.clear()
        if self._spec is not None:
            self._spec.flush()

    def record_cache_config(self, cache: CacheConfig, num_gpu_blocks: int) -> None:
        """vllm:cache_config_info = 1, labelled with the cache configuration (a dataclass)
        and the KV blocks the engine allocated, once at start-up."""
        info = {k: str(v) for k, v in dataclasses.asdict(cache).items()}
        info.update(num_gpu_blocks=str(num_gpu_blocks), engine=self._engine)
        cache_config_info(list(info)).labels(**info).set(1)

    def _log_if_due(self, stats: SchedulerStats, now: float) -> None:
        # Steps stop while the engine is idle; a window spanning the idle gap would report a
        # throughput nobody saw, so a step after a gap starts a fresh window.
        if now - self._last_record > self._interval:
            self._window_start = now
            self._window = [0, 0, 0, 0]
            if self._spec is not None:
                self._spec.reset_window()
        self._last_record = now
        if self._spec is not None and stats.spec_decoding is not None:
            self._spec.observe(stats.spec_decoding)
        w = self._window
        w[0] += stats.num_prompt_tokens
        w[1] += stats.num_generation_tokens
        w[2] += stats.prefix_cache_queries
        w[3] += stats.prefix_cache_hits
        elapsed = now - self._window_start
        if elapsed < self._interval:
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            w[0] / elapsed,
            w[1] / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            100 * w[3] / w[2] if w[2] else 0.0,
        )
        if self._spec is not None:
            self._spec.log(elapsed)
        self._window_start = now
        self._window = [0, 0, 0, 0]
