"""Gemma 2's and Gemma 3's own config.json fields, parsed and checked without torch: the
configuration refuses what gpu_worker/models/gemma2.py and gemma3.py cannot build when it
resolves (config/family_arch.py), and the model classes build from the same parse.

The fields (transformers 5.24's Gemma2Config and Gemma3TextConfig, whose defaults
config/hf_defaults.py fills in): query_pre_attn_scalar (the attention scale is its inverse
square root), attn_logit_softcapping and final_logit_softcapping (tanh caps on the attention
scores and on the logits, None for none), hidden_activation (the gated MLP's, GELU-tanh), the
per-layer kinds (layer_types: the sliding ones attend within sliding_window), and the rotary
embeddings: Gemma 2 has the usual one; Gemma 3 one for its full layers (rope_theta, default 1e6,
with rope_scaling) and one for its sliding layers (rope_local_base_freq, default 1e4, no
scaling), given in transformers 5's config.json as rope_parameters {"full_attention": {...},
"sliding_attention": {...}}.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from config.hf_defaults import filled
from config.model_arch import SUPPORTED_ROPE_TYPES

# Architecture -> its language model's model_type (whose defaults apply).
GEMMA_ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3_text",
}

_LAYER_KINDS = ("sliding_attention", "full_attention")
# Gemma 3's rotary bases where config.json gives none (Gemma3TextConfig.default_theta).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Scaling types whose parameters carry the pre-training context (max_position_embeddings when
# left out, as transformers' standardize_rope_params takes it).
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class GemmaRope:
    """One rotary embedding: its base and its scaling (None: the default frequencies)."""

    theta: float
    scaling: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """What a Gemma model class reads beyond ModelArchConfig."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    hidden_activation: str
    # Per layer: True where its kind is sliding_attention (its window is ModelArchConfig's
    # layer_sliding_window; Gemma 3 gives these layers sliding_rope).
    sliding_layers: tuple[bool, ...]
    full_rope: GemmaRope
    # Gemma 3's sliding layers' rotary embedding; None: the full layers' (Gemma 2).
    sliding_rope: GemmaRope | None
    qk_norm: bool  # Gemma 3: an RMSNorm on each head of q and k

    @property
    def attention_scale(self) -> float:
        """The attention scores' factor, query_pre_attn_scalar ** -0.5."""
        return self.query_pre_attn_scalar**-0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GemmaConfig:
        """Parse the (text) config.json of a Gemma architecture with transformers' defaults;
        ValueError naming the field for anything the model classes do not build: another
        hidden_activation, bidirectional attention, a scale or cap that is not a positive
        number, unknown layer kinds, or a rope scaling type the engine does not implement."""
        kind = GEMMA_ARCHITECTURES[architecture]
        cfg = filled(cfg, kind)
        act = cfg.get("hidden_activation")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"config.json: hidden_activation {act!r} is not supported (Gemma's "
                f"'gelu_pytorch_tanh' only)"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(
                "config.json: use_bidirectional_attention true (an embedding model) is not "
                "supported; the engine runs Gemma as a causal language model"
            )
        layers = int(cfg["num_hidden_layers"])
        types = list(cfg.get("layer_types") or [])
        if len(types) < layers or any(t not in _LAYER_KINDS for t in types[:layers]):
            raise ValueError(
                f"config.json: layer_types must name each of the {layers} layers "
                f"{' or '.join(_LAYER_KINDS)}, not {types!r}"
            )
        gemma3 = kind == "gemma3_text"
        full, sliding = _gemma3_ropes(cfg) if gemma3 else (_gemma2_rope(cfg), None)
        return cls(
            query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar"),
            attn_logit_softcapping=_cap(cfg, "attn_logit_softcapping"),
            final_logit_softcapping=_cap(cfg, "final_logit_softcapping"),
            hidden_activation=act,
            sliding_layers=tuple(t == "sliding_attention" for t in types[:layers]),
            full_rope=full,
            sliding_rope=sliding,
            qk_norm=gemma3,
        )


def check_gemma(architecture: str) -> Callable[[dict[str, Any]], None]:
    """config/family_arch.py's parser for a Gemma architecture: refuses (ValueError) what
    GemmaConfig.from_hf refuses; a dense model, so no experts (None)."""

    def parse(cfg: dict[str, Any]) -> None:
        GemmaConfig.from_hf(cfg, architecture)

    return parse


def _positive(cfg: dict[str, Any], name: str) -> float:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config.json: {name} must be a positive number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive number, not {value!r}")
    return float(value)


def _cap(cfg: dict[str, Any], name: str) -> float | None:
    """A soft cap: None (no capping) or a positive number."""
    return None if cfg.get(name) is None else _positive(cfg, name)


def _rope(params: dict[str, Any], theta: Any, max_positions: int, where: str) -> GemmaRope:
    """A rotary embedding from its parameters (rope_type and the type's fields); theta where
    params have no rope_theta."""
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: {where} rope scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    base = _positive({"rope_theta": params.get("rope_theta", theta)}, "rope_theta")
    if kind == "default":
        return GemmaRope(base, None)
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    if kind in _ORIGINAL_LEN_TYPES:
        scaling.setdefault("original_max_position_embeddings", max_positions)
    return GemmaRope(base, scaling)


def _gemma2_rope(cfg: dict[str, Any]) -> GemmaRope:
    """Gemma 2's one rotary embedding: rope_parameters (transformers 5), else rope_theta and
    rope_scaling at the top level."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", 10_000.0)
    return _rope(params, theta, int(cfg["max_position_embeddings"]), "the")


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[GemmaRope, GemmaRope]:
    """Gemma 3's (full layers', sliding layers') rotary embeddings from rope_parameters keyed by
    layer kind (filled() folds transformers 4's rope_theta, rope_local_base_freq and
    rope_scaling in)."""
    params = cfg["rope_parameters"]
    max_positions = int(cfg["max_position_embeddings"])
    full = _rope(
        params["full_attention"],
        _GEMMA3_THETA["full_attention"],
        max_positions,
        "the full-attention layers'",
    )
    sliding = _rope(
        params["sliding_attention"],
        _GEMMA3_THETA["sliding_attention"],
        max_positions,
        "the sliding-window layers'",
    )
    return full, sliding
