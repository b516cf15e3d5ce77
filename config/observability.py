"""ObservabilityConfig: what the processes log."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ObservabilityConfig:
    """What the processes log (vLLM's names)."""

    # No periodic throughput line from the engine core; /metrics keeps counting.
    disable_log_stats: bool = False
    # The API servers log each request they receive (id and body, cut at max_log_len).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # Every process's log level ('trace' logs as 'debug').
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"max_log_len must not be negative, got {self.max_log_len}")
