"""vLLM's --log-level and --disable-log-stats, applied in each process from its EngineConfig."""

from __future__ import annotations

import logging

from config.observability import ObservabilityConfig

# The project's top-level loggers: levels are set on these, never on the root logger, so an
# application that runs LLM in its own process keeps its logging as it was.
_LOGGERS = (
    "api_server",
    "engine_core",
    "executor",
    "frontend",
    "gpu_worker",
    "kernels",
    "metrics",
    "tokenizer_proc",
)
_LEVELS = {"trace": logging.DEBUG}


def apply_log_options(options: ObservabilityConfig) -> None:
    """Set the project's log level; silence the periodic stats line when disable_log_stats."""
    level = _LEVELS.get(options.log_level, logging.getLevelName(options.log_level.upper()))
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(level)
    if options.disable_log_stats:
        logging.getLogger("metrics.engine_stats").setLevel(max(level, logging.WARNING))
