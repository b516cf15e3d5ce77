"""The engine's own cost per step, apart from the model: where null-model's step time goes.

An in-process EngineCore runs the null-model workload (256 requests, 16 in, 128 out) once with
its phases timed: the scheduler (schedule, update_from_output), the runner's bookkeeping
(request-state updates, input preparation, sampling metadata, post-update, reading the output)
and the model (forward, logits, sampler). Overhead is everything but the model; with async
scheduling the scheduler's phases run while the model thread computes the step before. What
the timed phases leave of the step time is reported as unattributed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

# greedy_tokens: the output projection and the argmax in one kernel, for all-greedy steps.
_MODEL_PHASES = ("forward", "compute_logits", "sampler", "greedy_tokens")


def step_overhead(
    engine_kwargs: dict[str, Any],
    num_requests: int = 256,
    prompt_len: int = 16,
    output_len: int = 128,
) -> dict[str, Any]:
    """Milliseconds per step of each phase, the model's, and the overhead (the rest)."""
    from engine_core.engine_core import EngineCore
    from engine_core.resolve import resolved_config
    from gpu_worker import async_output
    from protocol.engine_core import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    config = resolved_config(**{**engine_kwargs, "distributed_executor_backend": "uni"})
    core = EngineCore(config)
    runner = core.executor.worker.runner
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)

    def run(tag: str) -> tuple[int, float]:
        for i in range(num_requests):
            ids = rng.integers(100, config.arch.vocab_size - 1, prompt_len).tolist()
            core.add_request(EngineCoreRequest(f"{tag}{i}", ids, params))
        steps, start = 0, time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps, time.perf_counter() - start

    run("warm")
    spent: dict[str, float] = defaultdict(float)
    timed = [
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update_from_output", "update_from_output"),
        (runner, "_update_states", "update_states"),
        (runner.inputs, "prepare", "prepare"),
        (runner.sampling, "metadata", "sampling_metadata"),
        (runner.states, "post_update", "post_update"),
        (runner.sampling, "post_update", "post_update"),
        (runner, "_forward", "forward"),
        (runner.model, "compute_logits", "compute_logits"),
        (runner, "sampler", "sampler"),
        (runner.model, "greedy_tokens", "greedy_tokens"),
        (async_output.AsyncOutput, "get_output", "get_output"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in timed]
    try:
        for owner, name, phase in timed:
            setattr(
                owner,
                name,
                _timing(getattr(owner, name), spent, phase, method=isinstance(owner, type)),
            )
        steps, seconds = run("timed")
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        core.shutdown()
    per_step = {phase: round(s / steps * 1e3, 3) for phase, s in spent.items()}
    model = sum(per_step.get(p, 0.0) for p in _MODEL_PHASES)
    overhead = sum(v for p, v in per_step.items() if p not in _MODEL_PHASES)
    total = seconds / steps * 1e3
    return {
        "steps": steps,
        "ms_per_step": round(total, 2),
        "model_ms": round(model, 2),
        "overhead_ms": round(overhead, 2),
        # Python glue between the timed phases (EngineCore.step, the runner's own lines).
        "unattributed_ms": round(total - model - overhead, 2),
        "async_scheduling": bool(config.scheduler.async_scheduling),
        "phases_ms": per_step,
    }


def _timing(fn: Callable, spent: dict[str, float], phase: str, method: bool) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - start

    if method:  # a function stored on the class: bind self through the descriptor protocol
        return lambda self, *a, **k: timed(self, *a, **k)
    return timed
