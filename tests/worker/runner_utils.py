"""Building a CPU model runner for tests."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_core.resolve import resolved_config
from gpu_worker.model_runner import ModelRunner
from tests.worker.driver import StepDriver


def make_runner(
    model: str | Path | None, attention_backend=None, **engine_args
) -> tuple[ModelRunner, StepDriver]:
    """A loaded runner with its KV cache, and a driver over all its blocks; attention_backend
    replaces the one the device would pick."""
    engine_args.setdefault("device", "cpu")
    engine_args.setdefault("kv_cache_memory", "64MiB")
    config = resolved_config(model=None if model is None else str(model), **engine_args)
    runner = ModelRunner(config, torch.device(config.device_type))
    if attention_backend is not None:
        runner.backend = attention_backend
    runner.load_model()
    num_blocks = runner.determine_num_blocks()
    runner.initialize_kv_cache(num_blocks)
    return runner, StepDriver(runner, num_blocks, config.cache.block_size)


def assert_first_logprobs_close(
    got: StepDriver, ref: StepDriver, prompts: dict[str, list[int]], **tolerance: float
) -> None:
    """Each prompt's first-token logprobs from got within bf16's tolerance of ref's (one step of
    both drivers, greedy, top 3)."""
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=3)
    ref.run(prompts, params, 1)
    got.run(prompts, params, 1)
    tolerance = {"atol": 0.05, "rtol": 0.02, **tolerance}
    for req in prompts:
        expected, actual = ref.logprobs[req][0], got.logprobs[req][0]
        torch.testing.assert_close(
            torch.tensor(actual.logprobs), torch.tensor(expected.logprobs), **tolerance
        )


def count_logits_calls(runner: ModelRunner, monkeypatch) -> list[int]:
    """A one-element counter of the runner's model.compute_logits calls from now on."""
    assert runner.model is not None
    real = runner.model.compute_logits
    calls = [0]

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    return calls
