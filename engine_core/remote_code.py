"""vLLM's --trust-remote-code, here: a model's own Python code is never run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def remote_code_notice(model_path: str, trust_remote_code: bool) -> str | None:
    """The notice for a model whose config.json names its own code (auto_map), else None."""
    config = Path(model_path) / "config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not auto_map:
        return None
    asked = "--trust-remote-code was given, but " if trust_remote_code else ""
    return (
        f"{config} names the model's own code (auto_map: {', '.join(sorted(auto_map))}); "
        f"{asked}this engine never runs remote code: it loads the architecture with its "
        f"own implementation"
    )


def log_remote_code_notice(model_path: str, trust_remote_code: bool) -> None:
    """Log the notice (the engine core does, once, where it loads the model)."""
    notice = remote_code_notice(model_path, trust_remote_code)
    if notice is not None:
        logger.warning(notice)
