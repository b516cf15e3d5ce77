"""A snapshot of this process's vllm: metrics as plain values, as vLLM's LLM.get_metrics()
returns them (vllm.v1.metrics.reader's Counter, Gauge, Histogram, and Vector: the per-position
counter vllm:spec_decode_num_accepted_tokens_per_pos folded into one list per label set)."""

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
class Vector(Metric):
    """A counter per draft position, values[j] for position j (labels without position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    # Upper bound ("0.1", "+Inf") -> cumulative count, as Prometheus exposes buckets.
    buckets: dict[str, int] = field(default_factory=dict)


_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _vectors(name: str, samples: list) -> list[Metric]:
    """One Vector per label set but position; positions no sample names read 0."""
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
        by_labels.setdefault(labels, {})[int(s.labels["position"])] = int(s.value)
    out: list[Metric] = []
    for labels, values in by_labels.items():
        vector = [0] * (max(values) + 1)
        for pos, value in values.items():
            vector[pos] = value
        out.append(Vector(name, dict(labels), vector))
    return out


def get_metrics_snapshot(registry: CollectorRegistry = REGISTRY) -> list[Metric]:
    """Every vllm: series of the registry: counters, gauges and histograms."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter" and family.name == _PER_POSITION:
            out += _vectors(family.name, [s for s in family.samples if s.name.endswith("_total")])
        elif family.type == "counter":
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
