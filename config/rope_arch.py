"""A model's rotary-embedding parameters as transformers 5.24 standardizes them
(PreTrainedConfig.standardize_rope_params): the scaling dict the model code reads, how many
leading dims of each head rotate, and how long a context the scaling extends the model to.
The frequencies themselves are computed in gpu_worker/layers/rope_scaling.py."""

from __future__ import annotations

import math
from typing import Any

# Rope scaling types the model code implements; anything else is refused at load time.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Older names a family's config class rewrites (Phi3Config: "su" and "yarn" mean LongRoPE).
_TYPE_ALIASES: dict[str, dict[str, str]] = {"phi3": {"su": "longrope", "yarn": "longrope"}}

# Types whose parameters carry the pre-training context length (transformers moves a top-level
# original_max_position_embeddings in, else takes max_position_embeddings).
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")

# Fields the scaling types require (transformers' _validate_*_rope_parameters).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),  # factor may be null: the context ratio (DeepSeek-V3)
    "longrope": ("short_factor", "long_factor"),
}


def rope_type(scaling: dict[str, Any]) -> str:
    """The scaling's type: rope_type, or the pre-v5 `type`, else "default"."""
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any] | None:
    """cfg's rope scaling (rope_scaling, else a flat rope_parameters whose type is not default)
    as transformers standardizes it: rope_type set (a family's aliases applied), rope_theta and
    partial_rotary_factor carried in, original_max_position_embeddings taken from the top level
    where config.json has it there (Phi-3), else from the dict, else max_position_embeddings.
    None for the default rotary embedding; ValueError naming source for a type the model code
    does not implement or a required field left out."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_type(params) != "default":
        scaling = params
    if scaling is None:
        return None
    kind = rope_type(scaling)
    kind = _TYPE_ALIASES.get(str(cfg.get("model_type", "")), {}).get(kind, kind)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind == "default":
        return None
    out = {k: v for k, v in scaling.items() if k != "type"}
    out["rope_type"] = kind
    out.setdefault("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("partial_rotary_factor") is not None:
        out.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if kind in _ORIGINAL_LEN_TYPES:
        if cfg.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        out.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if out["original_max_position_embeddings"] is None:
            raise ValueError(
                f"{source}: rope scaling {kind!r} needs original_max_position_embeddings"
            )
    missing = [k for k in _REQUIRED[kind] if out.get(k) is None]
    if missing:
        raise ValueError(f"{source}: rope scaling {kind!r} needs {', '.join(missing)}")
    return out


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The share of each head that rotates: partial_rotary_factor at the top level or in
    rope_parameters/rope_scaling (1.0 when absent)."""
    for where in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if where.get("partial_rotary_factor") is not None:
            return float(where["partial_rotary_factor"])
    return 1.0


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The leading dims of each head that rotate: int(head_dim * partial_rotary_factor), as
    transformers' rope functions compute dim; ValueError unless even and within the head."""
    dim = int(head_dim * partial_rotary_factor(cfg))
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {partial_rotary_factor(cfg)} gives {dim} rotary dims of a "
            f"{head_dim}-dim head; an even count between 2 and head_dim is needed"
        )
    return dim


def rope_context_len(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The longest context the scaling extends the model to, as vLLM derives max_model_len:
    max_position_embeddings times factor for linear and dynamic NTK, the original context times
    factor for YaRN (never less than max_position_embeddings); llama3 and LongRoPE configs give
    the extended length as max_position_embeddings already."""
    if scaling is None:
        return max_position_embeddings
    kind, factor = rope_type(scaling), scaling.get("factor")
    if kind in ("linear", "dynamic") and factor is not None:
        return max(max_position_embeddings, math.ceil(max_position_embeddings * float(factor)))
    if kind == "yarn" and factor is not None:
        extended = int(scaling["original_max_position_embeddings"]) * float(factor)
        return max(max_position_embeddings, math.ceil(extended))
    return max_position_embeddings


def long_rope_threshold(scaling: dict[str, Any] | None, max_model_len: int) -> int | None:
    """LongRoPE's original context when an engine serving max_model_len tokens can see a
    request outgrow it: a request whose tokens exceed it turns with the long factors (the
    engine core recomputes one that crosses it, as transformers' Phi-3 generate() re-encodes);
    None when every request stays short (no LongRoPE, or max_model_len within the original
    context)."""
    if scaling is None or rope_type(scaling) != "longrope":
        return None
    original = int(scaling["original_max_position_embeddings"])
    return original if max_model_len > original else None
