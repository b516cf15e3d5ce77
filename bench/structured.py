"""`engine bench structured`: what structured outputs cost.

offline-mixed (64 requests, prompts 32..256, outputs 16..128 tokens, greedy) twice in one run,
alternating: every request constrained by one JSON schema, then none, so the output lengths are
equal (the schema asks for at least 200 strings, so no request completes it before its
max_tokens). Then the time to first token of one request (max_tokens 1) unconstrained, with the
engine's first constraint (loads the vocabulary and compiles), with a new schema (compiles),
and with a schema compiled before (cached).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from config.args import engine_kwargs
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "minItems": 200, "items": {"type": "string"}}},
    "required": ["notes"],
}


def _schema(i: int) -> dict[str, Any]:
    """A schema of the same shape, different from every other i (so it compiles anew)."""
    return {
        "type": "object",
        "properties": {f"field_{i}": {"type": "integer"}, "name": {"type": "string"}},
        "required": [f"field_{i}", "name"],
    }


def bench_structured(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload; figures as a dict."""
    from bench.machine_limits import machine_info
    from bench.offline import random_prompts
    from frontend.llm import LLM

    llm = LLM(engine_process=not args.in_process, **engine_kwargs(args))
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(32, 257, 64)
    output_lens = rng.integers(16, 129, 64).tolist()
    prompts = [
        {"prompt_token_ids": p} for p in random_prompts(llm.get_tokenizer(), rng, prompt_lens)
    ]
    one = [{"prompt_token_ids": random_prompts(llm.get_tokenizer(), rng, [64])[0]}]

    def ttft(constraint: StructuredOutputsParams | None) -> float:
        start = time.perf_counter()
        llm.generate(
            one,
            SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=constraint),
            use_tqdm=False,
        )
        return time.perf_counter() - start

    ttft(None)  # warm-up
    ttft_ms = {
        "unconstrained": statistics.median(ttft(None) for _ in range(3)) * 1e3,
        "first_constraint": ttft(StructuredOutputsParams(json=_schema(0))) * 1e3,
        "new_schema": statistics.median(
            ttft(StructuredOutputsParams(json=_schema(i))) for i in range(1, 4)
        )
        * 1e3,
        "cached_schema": statistics.median(
            ttft(StructuredOutputsParams(json=_schema(1))) for _ in range(3)
        )
        * 1e3,
    }

    constrained = StructuredOutputsParams(json=SCHEMA)

    def run(constraint: StructuredOutputsParams | None) -> tuple[float, int]:
        params = [
            SamplingParams(
                temperature=0.0, ignore_eos=True, max_tokens=n, structured_outputs=constraint
            )
            for n in output_lens
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    run(constrained)  # warm-up (and the schema's compile)
    seconds: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    tokens = {}
    for _ in range(args.runs):
        for name, constraint in (("json_schema", constrained), ("unconstrained", None)):
            elapsed, n = run(constraint)
            seconds[name].append(elapsed)
            tokens[name] = n
    best = {name: min(s) for name, s in seconds.items()}
    llm.shutdown()
    return {
        "workload": "offline-mixed, every request constrained by one JSON schema, against none",
        "machine": machine_info(),
        "model": llm.config.model_path,
        "engine_core": "in-process" if args.in_process else "own process",
        "output_tokens": tokens,
        "seconds": {name: [round(x, 2) for x in s] for name, s in seconds.items()},
        "output_tok_s": {name: round(tokens[name] / best[name], 1) for name in best},
        "throughput_cost": round(1 - best["unconstrained"] / best["json_schema"], 3),
        "ttft_ms": {name: round(v, 1) for name, v in ttft_ms.items()},
        "schema": json.dumps(SCHEMA),
    }
