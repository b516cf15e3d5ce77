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
