"""The live view's numbers: one snapshot of the registry that /metrics renders.

Nothing here keeps its own counts: every value is read from the same collectors as GET /metrics
at the moment of the call, summed over label sets (engines, API servers, finish reasons). Rates
and last-minute percentiles are differences between two snapshots, computed by the page, so any
API server process answers with the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

from metrics.exposition import metrics_registry

# Page name -> (Prometheus family name, how label sets combine).
GAUGES = {
    "running": ("vllm:num_requests_running", "sum"),
    "waiting": ("vllm:num_requests_waiting", "sum"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "mean"),
}
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "preemptions": "vllm:num_preemptions",
    "requests_finished": "vllm:request_success",
}
# Registered only with --speculative-config: None when /metrics has no such family.
SPEC_COUNTERS = {
    "spec_drafts": "vllm:spec_decode_num_drafts",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


def _le(value: str) -> float:
    return math.inf if value == "+Inf" else float(value)


def snapshot(path: str | None = None) -> dict[str, Any]:
    """Gauges, counter totals and cumulative histogram buckets, as /metrics has them now
    (the speculative-decoding totals None without speculative decoding)."""
    families = {f.name: f for f in metrics_registry(path).collect()}
    out: dict[str, Any] = {}
    for key, (name, combine) in GAUGES.items():
        values = [s.value for s in families[name].samples] if name in families else []
        total = sum(values)
        out[key] = total / len(values) if combine == "mean" and values else total
    for key, name in COUNTERS.items():
        fam = families.get(name)
        out[key] = sum(s.value for s in fam.samples if s.name == name + "_total") if fam else 0.0
    for key, name in SPEC_COUNTERS.items():
        fam = families.get(name)
        out[key] = sum(s.value for s in fam.samples if s.name == name + "_total") if fam else None
    for key, name in HISTOGRAMS.items():
        buckets: dict[float, float] = {}
        total = count = 0.0
        for s in families[name].samples if name in families else ():
            if s.name == name + "_bucket":
                le = _le(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == name + "_sum":
                total += s.value
            elif s.name == name + "_count":
                count += s.value
        bounds = sorted(buckets)
        # JSON has no infinity: the +Inf bucket's count is `count`.
        out[key] = {
            "le": [b for b in bounds if b != math.inf],
            "cumulative": [buckets[b] for b in bounds if b != math.inf],
            "sum": total,
            "count": count,
        }
    return out
