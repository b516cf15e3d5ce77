"""The model's generation_config.json as request defaults (vLLM's --generation-config and
--override-generation-config): which file, which keys, read once when the configuration resolves."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.errors import ConfigError

if TYPE_CHECKING:
    from config.model import ModelConfig

logger = logging.getLogger(__name__)

# The generation_config.json keys vLLM turns into request defaults; max_new_tokens becomes
# max_tokens, a cap on every request's output (vLLM takes the smallest of it, the request's
# max_tokens and the rest of the context).
DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_config_file(model: ModelConfig, model_path: str) -> Path | None:
    """The generation_config.json that --generation-config names, or None ('vllm', or a model
    without one)."""
    if model.generation_config == "vllm":
        return None
    if model.generation_config == "auto":
        folder = Path(model_path)
        if not folder.is_dir():  # a .gguf file: its metadata carries no sampling defaults
            return None
        path = folder / "generation_config.json"
        return path if path.is_file() else None
    return Path(model.generation_config) / "generation_config.json"


def check_generation_config(model: ModelConfig, model_path: str) -> None:
    """ConfigError for a --generation-config folder without generation_config.json, or an
    override key that is not one of DEFAULT_KEYS. (engine_core/generation_config.py checks
    the defaults' values against SamplingParams.)"""
    path = generation_config_file(model, model_path)
    if path is not None and not path.is_file():
        raise ConfigError(
            f"--generation-config {model.generation_config}: no "
            f"generation_config.json in that folder (or use 'auto' or 'vllm')"
        )
    unknown = sorted(set(model.override_generation_config or {}) - set(DEFAULT_KEYS))
    if unknown:
        raise ConfigError(
            f"override_generation_config: {', '.join(unknown)} cannot be a "
            f"request default; the keys are {', '.join(DEFAULT_KEYS)}"
        )


def default_sampling_params(model: ModelConfig, model_path: str) -> dict[str, Any]:
    """The sampling defaults for requests that leave a field unset: the set DEFAULT_KEYS of the
    generation config, then the override, with max_new_tokens named max_tokens."""
    path = generation_config_file(model, model_path)
    config: dict[str, Any] = {}
    if path is not None:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read the generation config ({e})") from None
    override = model.override_generation_config
    assert not isinstance(override, str), "ModelConfig decodes a JSON override when built"
    config.update(override or {})
    defaults = {k: config[k] for k in DEFAULT_KEYS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def log_defaults(defaults: dict[str, Any]) -> None:
    """Say which defaults the model's generation config set (vLLM warns the same way)."""
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation config: %s "
            "(requests that set a field keep theirs; --generation-config vllm turns "
            "this off)",
            defaults,
        )
