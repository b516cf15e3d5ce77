"""vLLM-named Prometheus metrics, created once per process (multiprocess-safe when
PROMETHEUS_MULTIPROC_DIR is set before prometheus_client is first imported)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

# How long a series updated on every step or token may hold its values before they reach
# Prometheus while requests run (metrics/engine_stats.py, metrics/request_stats.py): each update
# writes a memory-mapped file under PROMETHEUS_MULTIPROC_DIR, on the per-token path.
HOLD_S = 1.0

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
# vLLM's PromptTokenStats.ALL_SOURCES (no KV transfer here: external_kv_transfer stays 0).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# engine: the engine core's data-parallel rank ("0" without data parallelism), as vLLM labels.
_LABELS = ["model_name", "engine"]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value, as vLLM builds token-count buckets."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class EngineMetrics:
    """Metrics the engine core process writes, from SchedulerStats."""

    num_requests_running: Gauge
    num_requests_waiting: Gauge
    kv_cache_usage_perc: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    num_preemptions: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    iteration_tokens: Histogram
    prompt_tokens_cached: Counter
    prompt_tokens_by_source: Counter  # extra label: source (PROMPT_TOKEN_SOURCES)


@dataclass(frozen=True)
class RequestMetrics:
    """Metrics the tokenizer processes write, from each request's timeline."""

    request_success: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    request_prefill_time: Histogram
    request_decode_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_inference_time: Histogram
    request_time_per_output_token: Histogram
    request_params_n: Histogram
    request_params_max_tokens: Histogram


@dataclass(frozen=True)
class SpecDecodeMetrics:
    """Speculative decoding's counters, which the engine core writes from
    SchedulerStats.spec_decoding; registered only when --speculative-config is given (as vLLM)."""

    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter  # extra label: position (0 .. k-1)


_engine_metrics: EngineMetrics | None = None
_spec_decode_metrics: SpecDecodeMetrics | None = None
_request_metrics: RequestMetrics | None = None


def _gauge(name: str, doc: str) -> Gauge:
    # One engine core writes each series; 'live' drops a dead engine's last value once the
    # launcher calls mark_process_dead(pid).
    return Gauge(name, doc, _LABELS, multiprocess_mode="livemostrecent")


def _counter(name: str, doc: str, *extra_labels: str) -> Counter:
    return Counter(name, doc, [*_LABELS, *extra_labels])


def _histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
    return Histogram(name, doc, _LABELS, buckets=buckets)


def _phase_histogram(name: str, phase: str) -> Histogram:
    """A request's time in one phase of its life (vLLM's help text names the phase)."""
    return _histogram(
        name, f"Histogram of time spent in {phase} phase for request.", REQUEST_LATENCY_BUCKETS
    )


def engine_metrics() -> EngineMetrics:
    """This process's engine metrics (created on first call: a name may be registered once)."""
    global _engine_metrics
    if _engine_metrics is None:
        _engine_metrics = EngineMetrics(
            _gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            _counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            _counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
            ),
            _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            _counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            _counter("vllm:generation_tokens", "Number of generation tokens processed."),
            _histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKEN_BUCKETS,
            ),
            _counter(
                "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local prefix cache)."
            ),
            _counter(
                "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source"
            ),
        )
    return _engine_metrics


def spec_decode_metrics() -> SpecDecodeMetrics:
    """This process's speculative-decoding counters (created on first call)."""
    global _spec_decode_metrics
    if _spec_decode_metrics is None:
        _spec_decode_metrics = SpecDecodeMetrics(
            _counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            _counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            _counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            _counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                "position",
            ),
        )
    return _spec_decode_metrics


_cache_config_info: Gauge | None = None


def cache_config_info(label_names: list[str]) -> Gauge:
    """vllm:cache_config_info, an info gauge (value 1) labelled with the cache configuration;
    its label names come from the first call (vLLM's CacheConfig.metrics_info() keys)."""
    global _cache_config_info
    if _cache_config_info is None:
        _cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            label_names,
            multiprocess_mode="livemostrecent",
        )
    return _cache_config_info


def request_metrics(max_model_len: int) -> RequestMetrics:
    """This process's request metrics; token buckets reach max_model_len (first call's value)."""
    global _request_metrics
    if _request_metrics is None:
        token_buckets = build_1_2_5_buckets(max_model_len)
        _request_metrics = RequestMetrics(
            _counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                "finished_reason",
            ),
            _histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            _histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            _histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_LATENCY_BUCKETS,
            ),
            _phase_histogram("vllm:request_queue_time_seconds", "WAITING"),
            _phase_histogram("vllm:request_prefill_time_seconds", "PREFILL"),
            _phase_histogram("vllm:request_decode_time_seconds", "DECODE"),
            _histogram(
                "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
            ),
            _histogram(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                token_buckets,
            ),
            _phase_histogram("vllm:request_inference_time_seconds", "RUNNING"),
            _histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                ITL_BUCKETS,
            ),
            _histogram(
                "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
            ),
            _histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                token_buckets,
            ),
        )
    return _request_metrics
