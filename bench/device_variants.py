"""engine bench device's variants: what --quantization and --kv-cache-dtype fp8 ask to run
beside the dense baseline, and each variant's ratios to it and issue 32's targets."""

from __future__ import annotations

import argparse
from typing import Any

GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QUANTIZATIONS = ("fp8", "gptq", "awq", *(f"gguf-{t}" for t in GGUF_TYPES))
# Issue 32's targets: the largest ratio of step times to the baseline's (graphs and async on).
TARGETS = {"fp8": {1: 0.6, 64: 0.65}, "int4": {1: 0.4}, "kv-fp8": {1: 0.85}}


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """The workload's --quantization, in place of the engine's (parser resolves the conflict):
    a list of variants, each measured against the dense baseline."""
    parser.add_argument(
        "--quantization",
        type=quantization_list,
        dest="quantization",
        default=None,
        metavar="Q[,Q...]",
        help="also run the shape with its linear weights quantized, each against the dense "
        "baseline in the same run: fp8 (per output channel, W8A8 where the GPU has fp8 "
        "tensor cores), gptq or awq (4-bit, groups of 128) quantize the dummy weights at load; "
        "gguf-TYPE (gguf-Q4_K, ...) reads a random GGUF file of that type",
    )


def quantization_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in QUANTIZATIONS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"engine bench device runs --quantization fp8, gptq, awq or gguf-TYPE (TYPE one of "
            f"{', '.join(GGUF_TYPES)}), comma-separated; got {value!r}"
        )
    return names


def variants_of(kwargs: dict[str, Any], gguf_type: str | None) -> list[dict[str, Any]]:
    """The variants measured against the dense baseline (popping their flags from kwargs):
    each --quantization; with --kv-cache-dtype fp8, the dense model with that cache, then each
    quantization with the model dtype's cache and with fp8's (the cache compared on the same
    weights)."""
    quantizations: list[str] = kwargs.pop("quantization", None) or []
    if gguf_type is not None:
        if quantizations:
            raise ValueError(
                "--gguf-type TYPE is --quantization gguf-TYPE: pass one of the two flags"
            )
        quantizations = [f"gguf-{gguf_type}"]
    kv = kwargs.pop("kv_cache_dtype", "auto")
    kv = "fp8" if kv == "fp8_e4m3" else kv
    caches = ("auto",) if kv == "auto" else ("auto", kv)
    asked: list[tuple[str | None, str]] = [(q, c) for q in quantizations for c in caches]
    if kv != "auto":
        asked.insert(0, (None, kv))
    variants = []
    for q, cache in asked:
        gguf = q[len("gguf-") :] if q is not None and q.startswith("gguf-") else None
        name = "+".join([n for n in (q, None if cache == "auto" else f"kv-{cache}") if n])
        variants.append(
            {
                "name": name,
                "quantization": None if gguf else q,
                "gguf_type": gguf,
                "kv_cache_dtype": cache,
            }
        )
    return variants


def ratio(run: dict[str, Any], baseline: list[dict[str, Any]]) -> float | None:
    """run's step time over the baseline run's at the same batch size, graphs and scheduling."""
    key = ("batch_size", "cuda_graphs", "async_scheduling")
    same = [b for b in baseline if all(b[k] == run[k] for k in key)]
    return round(run["ms_per_step"] / same[0]["ms_per_step"], 3) if same else None


def target_checks(variant: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 32's targets for this variant on its fastest mode's runs (async scheduling on,
    graphs where there are any): each with the measured figure and whether it is met."""
    graphs = any(r["cuda_graphs"] for r in runs)
    best = {
        r["batch_size"]: r for r in runs if r["async_scheduling"] and r["cuda_graphs"] == graphs
    }
    q = variant["quantization"] or variant["gguf_type"] or ""
    kind = "fp8" if q == "fp8" else "int4" if q in ("gptq", "awq") or q.startswith("Q4") else None
    key, against = "ms_ratio_to_baseline", "baseline"
    if variant["kv_cache_dtype"] == "fp8":  # the cache's target, on the same weights
        kind, key, against = "kv-fp8", "ms_ratio_to_same_weights", "same weights, model's cache"
    checks = []
    for batch, bound in TARGETS.get(kind or "", {}).items():
        if batch in best and best[batch][key] is not None:
            value = best[batch][key]
            checks.append(_check(f"batch {batch}: step time / {against} <= {bound}", value, bound))
    if kind == "int4":
        if 1 in best and 16 in best:
            own = round(best[16]["ms_per_step"] / best[1]["ms_per_step"], 3)
            checks.append(_check("batch 16 step time / own batch 1 <= 1.15", own, 1.15))
        ratios = [r["ms_ratio_to_baseline"] for r in best.values() if r["batch_size"] <= 64]
        if ratios and None not in ratios:
            checks.append(
                _check("every batch up to 64: step time / baseline <= 1.0", max(ratios), 1.0)
            )
    return checks


def _check(target: str, value: float, bound: float) -> dict[str, Any]:
    return {"target": target, "value": value, "met": value <= bound}
