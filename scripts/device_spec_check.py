"""Speculative decoding on a GPU with dummy weights (docs/device.md, stage `spec`).

The Llama-3-8B shape at batch 1, driven through EngineCore with token ids (no tokenizer), on the
editing workload's shape: a prompt holding a 254-token "text" after a 48-token "instruction",
254 tokens decoded greedily (ignore_eos). Three engines, one after the other, each shut down
before the next: without speculation (the baseline, the engine's defaults), n-gram, and a
draft model of the Llama-3.2-1B shape (its own dummy weights). For each: decode tokens/s after
the first token and ms per step (medians of --runs), tokens per step, the acceptance counts
summed from the steps' SchedulerStats.spec_decoding, and whether the greedy tokens equal the
baseline's (bf16: a verification batch may round differently from a one-token step).

Dummy weights decide what is accepted: the draft model's random weights disagree with the
target's (acceptance near zero: the figure is the draft's overhead, target <= 10% of the step),
and n-gram accepts whatever repeats in the random model's output (the figure is the ratio at
the acceptance measured, target >= 2x). Prints one JSON object.

    python scripts/device_spec_check.py [--runs 3] [--shape llama3-8b --draft-shape llama3.2-1b]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.device_shapes import SHAPES, write_model_dir
from bench.spec_workload import acceptance, decode_once

logger = logging.getLogger("device_spec_check")

TEXT_TOKENS, INSTRUCTION_TOKENS = 254, 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
DRAFT_TOKENS = 3


def editing_ids(vocab: int, seed: int = 0) -> list[int]:
    """The workload's prompt as token ids: an instruction, then the text to edit."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(vocab // 8, vocab, INSTRUCTION_TOKENS + TEXT_TOKENS).tolist()


def run_engine(name: str, kwargs: dict[str, Any], prompt: list[int], runs: int) -> dict[str, Any]:
    """Warm-up, then --runs timed requests on one EngineCore, shut down and freed after."""
    import torch

    from engine_core.engine_core import EngineCore
    from engine_core.resolve import resolved_config

    config = resolved_config(**kwargs)
    core = EngineCore(config)
    try:
        decode_once(core, f"{name}-warmup", prompt[:32], 8)
        results = [decode_once(core, f"{name}-{i}", prompt, TEXT_TOKENS) for i in range(runs)]
    finally:
        core.shutdown()
        del core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rates = [(TEXT_TOKENS - 1) / r["seconds"] for r in results]
    ms = [r["seconds"] / r["steps"] * 1e3 for r in results]
    return {
        "async_scheduling": config.scheduler.async_scheduling,
        "cuda_graphs": bool(config.cuda_graph_capture_sizes()),
        "decode_tok_s": round(statistics.median(rates), 2),
        "runs_tok_s": [round(r, 2) for r in rates],
        "ms_per_step": round(statistics.median(ms), 3),
        "tokens_per_step": round(
            (TEXT_TOKENS - 1) / statistics.median(r["steps"] for r in results), 3
        ),
        **acceptance([r["spec"] for r in results]),
        "tokens": results[0]["tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES))
    parser.add_argument("--draft-shape", default="llama3.2-1b", choices=tuple(SHAPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ngram-config", default=json.dumps(NGRAM), help="n-gram's JSON")
    parser.add_argument("--draft-tokens", type=int, default=DRAFT_TOKENS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from bench.machine_limits import machine_info

    vocab = SHAPES[args.shape]["vocab_size"]
    if SHAPES[args.draft_shape]["vocab_size"] != vocab:
        raise SystemExit(f"{args.draft_shape} and {args.shape} have different vocabularies")
    prompt = editing_ids(vocab)
    with tempfile.TemporaryDirectory(prefix="engine-spec-check-") as tmp:
        target, draft = Path(tmp, "target"), Path(tmp, "draft")
        for directory, shape in ((target, args.shape), (draft, args.draft_shape)):
            directory.mkdir()
            write_model_dir(directory, shape)
        common = {
            "model": str(target),
            "load_format": "dummy",
            "device": args.device,
            "max_model_len": 1024,
            "max_num_seqs": 4,
            "kv_cache_memory": "2GiB",
        }
        draft_config = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": args.draft_tokens,
        }
        engines = {
            "baseline": common,
            "ngram": {**common, "speculative_config": args.ngram_config},
            "draft_model": {**common, "speculative_config": json.dumps(draft_config)},
        }
        result: dict[str, Any] = {
            "workload": "spec-device",
            "machine": machine_info(),
            "shape": args.shape,
            "draft_shape": args.draft_shape,
            "prompt_tokens": len(prompt),
            "new_tokens": TEXT_TOKENS,
            "ngram_config": json.loads(args.ngram_config),
            "draft_config": {**draft_config, "model": args.draft_shape},
        }
        for name, kwargs in engines.items():
            began = time.perf_counter()
            try:
                result[name] = run_engine(name, kwargs, prompt, args.runs)
            except Exception as exc:  # the other engines' figures still come back
                logger.exception("%s failed", name)
                result[name] = {"error": repr(exc)}
            result[name]["seconds_total"] = round(time.perf_counter() - began, 1)
    summarise(result)
    print(json.dumps(result, indent=2))
    return 0 if all("error" not in result[n] for n in engines) else 1


def summarise(result: dict[str, Any]) -> None:
    """Ratios to the baseline and the issue's targets; token lists replaced by equality."""
    base = result["baseline"]
    base_tokens = base.pop("tokens", None)
    for name in ("ngram", "draft_model"):
        r = result[name]
        tokens = r.pop("tokens", None)
        if "error" in r or "error" in base:
            continue
        r["greedy_tokens_identical"] = tokens == base_tokens
        r["ratio_tok_s"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
        r["ms_per_step_ratio"] = round(r["ms_per_step"] / base["ms_per_step"], 3)
    ngram, draft = result["ngram"], result["draft_model"]
    targets = []
    if "ratio_tok_s" in ngram:
        targets.append({"target": "n-gram >= 2x decode tok/s", "value": ngram["ratio_tok_s"],
                        "met": ngram["ratio_tok_s"] >= 2.0})  # fmt: skip
    if "ms_per_step_ratio" in draft:
        overhead = draft["ms_per_step_ratio"] - 1
        targets.append({"target": "draft model's step overhead <= 10% (at its acceptance)",
                        "value": round(overhead, 3), "met": overhead <= 0.10,
                        "acceptance_rate": draft["acceptance_rate"]})  # fmt: skip
    result["targets"] = targets


if __name__ == "__main__":
    sys.exit(main())
