"""A snapshot of this process's vllm: metrics as plain values, as vLLM's LLM.get_metrics()
returns them (vllm.v1.metrics.reader's Counter, Gauge and Histogram; its Vector folds the
speculative-decoding counters, which this engine does not have)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry


@dataclass
class Metric:
    """A metric's name and one series' labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    # Upper bound ("0.1", "+Inf") -> cumulative count, as Prometheus exposes buckets.
    buckets: dict[str, int] = field(default_factory=dict)


def get_metrics_snapshot(registry: CollectorRegistry = REGISTRY) -> list[Metric]:
    """Every vllm: series of the registry: counters, gauges and histograms."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter":
            out += [
                Counter(family.name, dict(s.labels), int(s.value))
                for s in family.samples
                if s.name.endswith("_total")
            ]
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            series: dict[tuple, Histogram] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                key = tuple(sorted(labels.items()))
                h = series.setdefault(key, Histogram(family.name, labels, 0, 0.0))
                if s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    h.count = int(s.value)
                elif s.name.endswith("_sum"):
                    h.sum = s.value
            out += series.values()
    return out
