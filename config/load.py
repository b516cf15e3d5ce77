"""LoadConfig: where the weights come from."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(slots=True)
class LoadConfig:
    """Where weights come from."""

    load_format: str = "auto"
    # vLLM's --download-dir: the Hugging Face cache a Hub model is looked up in and downloaded
    # to (None: huggingface_hub's, from HF_HUB_CACHE or HF_HOME).
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
