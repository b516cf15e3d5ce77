"""The one place a configuration is resolved: what the flags or keyword arguments say, checked
against the model directory, the device and the kernels this machine has. The launcher (or LLM,
or a standalone engine core) calls it once; every process it starts receives the result."""

from __future__ import annotations

from typing import Any

from config.engine import EngineConfig, engine_config_from_kwargs
from engine_core.generation_config import check_sampling_defaults
from kernels import cpu_library


def resolve_config(config: EngineConfig) -> EngineConfig:
    """config resolved in place (EngineConfig.resolve) and checked; ConfigError names what is
    wrong."""
    config.resolve(cpu_kernels_available=cpu_library.available)
    check_sampling_defaults(config)
    return config


def resolved_config(**engine_args: Any) -> EngineConfig:
    """The resolved configuration of vLLM-style keyword arguments."""
    return resolve_config(engine_config_from_kwargs(**engine_args))
