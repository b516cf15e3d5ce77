"""Models named as on the Hugging Face Hub: 'org/name' (a model repository), 'org/name:QUANT'
(the one .gguf file of a GGUF repository whose name carries QUANT, e.g. Q4_K_M, as vLLM and
llama.cpp read it). Found in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME, or
--download-dir) with huggingface_hub, or downloaded with it unless HF_HUB_OFFLINE is set; a
model that is neither is refused in one line naming the repository, revision, cache and files.

huggingface_hub is imported only when a Hub id is resolved: every other model needs none of it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.errors import ConfigError

logger = logging.getLogger(__name__)

# The files the engine reads from a model repository: its config, generation defaults, the
# tokenizer and the safetensors weights at the top level (subfolders such as original/ hold
# other formats of the same weights; consolidated*.safetensors is Mistral's own layout of them).
_CONFIG_FILES = ["config.json", "generation_config.json"]
_TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
]
_WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
_IGNORED = ["*/*", "consolidated*"]
_INDEX = "model.safetensors.index.json"
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
_SHARD = re.compile(r".*-(\d+)-of-(\d+)\.(safetensors|gguf)")
_QUANT = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class HubOptions:
    """Where and what to look up: vLLM's --revision, --download-dir and --hf-token."""

    revision: str | None = None
    download_dir: str | None = None
    token: str | bool | None = None


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, quantization) when name reads as a Hub id ('org/name', 'name', 'org/name:QUANT')
    and is no existing local path; None for a path (written with '/', '.', '~' first, or
    existing)."""
    if Path(name).expanduser().exists() or name.startswith(("/", ".", "~")):
        return None
    repo_id, _, quant = name.partition(":")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    if quant and not _QUANT.fullmatch(quant):
        return None
    return repo_id, quant or None


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, as huggingface_hub reads it;
    read now, so that a variable set after huggingface_hub was imported counts too."""
    from huggingface_hub import constants

    values = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(
        (v or "").upper() in ("1", "ON", "YES", "TRUE") for v in values
    )


def hub_cache(options: HubOptions) -> str:
    """The cache searched and filled: --download-dir, else huggingface_hub's (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return str(Path(options.download_dir or constants.HF_HUB_CACHE).expanduser().resolve())


def snapshot_dir(
    repo_id: str, options: HubOptions, *, weights: bool, tokenizer: bool, what: str = "model"
) -> Path:
    """The local snapshot of repo_id at options.revision holding config.json, and the
    safetensors weights and tokenizer files when asked: taken from the cache, else downloaded.
    ConfigError in one line when the files are neither cached nor downloadable."""
    from huggingface_hub import errors, snapshot_download

    # Raised by huggingface_hub releases that cache the repository's file listing (2.x): the
    # snapshot is still there, and missing_files() judges it.
    incomplete: Any = getattr(errors, "IncompleteSnapshotError", ())

    patterns = _CONFIG_FILES + (_WEIGHT_FILES if weights else []) + _TOKENIZER_FILES
    offline, error = hub_offline(), None
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=options.revision,
                cache_dir=hub_cache(options),
                token=options.token,
                allow_patterns=patterns,
                ignore_patterns=_IGNORED,
                local_files_only=offline,
            )
        )
    except incomplete as e:  # the cached file listing names more than is here
        folder, error = Path(e.snapshot_path), e
    except Exception as e:  # huggingface_hub's OSErrors and its HTTP library's errors
        needed = _needed(weights=weights, tokenizer=tokenizer)
        found = f"no snapshot (so none of {needed})"
        raise ConfigError(_refusal(repo_id, options, what, found, _why(e, offline))) from e
    missing = missing_files(folder, weights=weights, tokenizer=tokenizer)
    if missing:
        # Online, snapshot_download fetched every file there is: the repository lacks them.
        why = _why(error, offline) if offline or error else "the repository on the Hub has none"
        found = f"snapshot {folder} lacks {', '.join(missing)}"
        raise ConfigError(_refusal(repo_id, options, what, found, why))
    logger.info("%s %s (revision %s) is at %s", what, repo_id, _rev(options), folder)
    return folder


def missing_files(folder: Path, *, weights: bool, tokenizer: bool) -> list[str]:
    """What folder lacks for the engine to load it: config.json, the safetensors weights (every
    shard the index or a shard's name counts), a tokenizer."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if weights:
        missing += _missing_weights(folder)
    if tokenizer and not any((folder / f).is_file() for f in _TOKENIZER_MARKERS):
        missing.append("tokenizer.json or tokenizer_config.json")
    return missing


def _needed(*, weights: bool, tokenizer: bool) -> str:
    names = ["config.json", *(["*.safetensors"] if weights else [])]
    return ", ".join(names + (["tokenizer.json or tokenizer_config.json"] if tokenizer else []))


def _missing_weights(folder: Path) -> list[str]:
    import json

    index = folder / _INDEX
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(s for s in shards if not (folder / s).is_file())
    present = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not present:
        return ["*.safetensors"]
    shard = _SHARD.fullmatch(present[0])
    return [_INDEX] if shard and int(shard.group(2)) > 1 else []


def gguf_file(repo_id: str, quant: str, options: HubOptions) -> Path:
    """The .gguf file of repo_id whose name carries quant (case aside, not as part of a longer
    name: Q4_K does not pick Q4_K_M), from the cache or downloaded; ConfigError in one line when
    there is none, several, or it cannot be had."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    offline, reason = hub_offline(), None
    what = f"GGUF {quant} of"
    files: list[str] | None = None
    if not offline:
        try:
            files = HfApi(token=options.token).list_repo_files(repo_id, revision=options.revision)
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise ConfigError(_refusal(repo_id, options, what, "no file", _why(e, False))) from e
        except Exception as e:  # unreachable: the cache may still hold it
            reason = e
    if files is None:
        try:
            folder = Path(
                snapshot_download(
                    repo_id,
                    revision=options.revision,
                    cache_dir=hub_cache(options),
                    allow_patterns=["*.gguf"],
                    local_files_only=True,
                )
            )
        except Exception as e:  # no snapshot of that revision in the cache
            why = _why(reason, offline)
            found = "no snapshot (so no .gguf file)"
            raise ConfigError(_refusal(repo_id, options, what, found, why)) from e
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    name = _pick_gguf(repo_id, quant, files, options, offline or reason is not None)
    try:
        path = hf_hub_download(
            repo_id,
            name,
            revision=options.revision,
            cache_dir=hub_cache(options),
            token=options.token,
            local_files_only=offline or reason is not None,
        )
    except Exception as e:  # not downloadable now
        why = _why(reason or e, offline)
        raise ConfigError(_refusal(repo_id, options, what, f"no {name}", why)) from e
    logger.info("GGUF %s of %s (revision %s) is %s", quant, repo_id, _rev(options), path)
    return Path(path)


def _pick_gguf(
    repo_id: str, quant: str, files: list[str], options: HubOptions, cached_only: bool
) -> str:
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    chosen = sorted(f for f in files if f.endswith(".gguf") and pattern.search(Path(f).name))
    where = f"in the cache {hub_cache(options)}" if cached_only else "on the Hub"
    if not chosen:
        names = ", ".join(sorted(Path(f).name for f in files if f.endswith(".gguf"))) or "none"
        raise ConfigError(
            f"model {repo_id}:{quant} (revision {_rev(options)}): no .gguf file {where} has "
            f"{quant} in its name (.gguf files: {names})"
        )
    if any(_SHARD.fullmatch(Path(f).name) for f in chosen):
        raise ConfigError(
            f"model {repo_id}:{quant}: {chosen[0]} is one part of a split GGUF file; the engine "
            f"reads single-file GGUF models (merge the parts with llama.cpp's gguf-split --merge)"
        )
    if len(chosen) > 1:
        raise ConfigError(
            f"model {repo_id}:{quant}: several .gguf files {where} match {quant}: "
            f"{', '.join(chosen)}; name the quantization in full"
        )
    return chosen[0]


def _rev(options: HubOptions) -> str:
    return options.revision or "main"


def _refusal(repo_id: str, options: HubOptions, what: str, found: str, why: str) -> str:
    hint = ""
    if what == "model" and repo_id.upper().endswith("GGUF"):
        hint = "; a GGUF repository is named with its quantization: org/name:Q4_K_M"
    return (
        f"{what} {repo_id} (revision {_rev(options)}) cannot be loaded from the Hugging Face "
        f"cache {hub_cache(options)}: {found}; {why}{hint}"
    )


def _why(error: Any, offline: bool) -> str:
    """Why the Hub did not provide the files, in a few words."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if offline:
        return "HF_HUB_OFFLINE is set, so nothing is downloaded (unset it to download)"
    cause = error.__cause__ if error is not None and error.__cause__ is not None else error
    if isinstance(error, GatedRepoError) or isinstance(cause, GatedRepoError):
        return "the repository is gated: accept its terms on the Hub and pass --hf-token"
    if isinstance(error, RevisionNotFoundError) or isinstance(cause, RevisionNotFoundError):
        return "the Hub has no such revision"
    if isinstance(error, RepositoryNotFoundError) or isinstance(cause, RepositoryNotFoundError):
        return "the Hub has no such repository (or it is private: pass --hf-token)"
    detail = f"{type(cause).__name__}: {cause}".splitlines()[0] if cause is not None else ""
    return f"the Hub is unreachable ({detail})" if detail else "the Hub is unreachable"
