"""The own config.json fields of dense families with the shared gated MLP (Granite, OLMo 2),
parsed and checked without torch: the configuration refuses what the model classes cannot build
when it resolves (config/family_arch.py), and gpu_worker/models/granite.py and olmo2.py build
from the same checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from config.hf_defaults import filled


def _finite(cfg: dict[str, Any], name: str, *, positive: bool = False) -> float:
    """config.json's float field `name` (transformers' default where left out: filled()); a
    ValueError naming it unless it is a finite number (and > 0 where positive)."""
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"config.json: {name} must be a finite number, not {value!r}")
    if positive and value <= 0:
        raise ValueError(f"config.json: {name} must be > 0, not {value!r}")
    return float(value)


def require_plain_gated_mlp(cfg: dict[str, Any]) -> None:
    """The model's MLP is the shared SwiGLU one without biases (GatedMLP): refuse another
    hidden_act or mlp_bias true (a ValueError naming the field)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias true is not supported (MLP without biases)")


@dataclass(frozen=True, slots=True)
class GraniteConfig:
    """Granite's four scalars. embedding_multiplier: the token embeddings' factor;
    residual_multiplier: each attention and MLP output's factor before its residual add;
    attention_multiplier: the attention scores' scale (instead of head_dim ** -0.5);
    logits_scaling: the logits are divided by it."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GraniteConfig:
        """Parse config.json with transformers' defaults (1.0 each); ValueError naming the field
        that is not a finite number, a logits_scaling <= 0 (dividing by it must keep the
        logits' order: greedy tokens come from the unscaled projection), a hidden_act other
        than silu, or mlp_bias."""
        cfg = filled(cfg, "granite")
        require_plain_gated_mlp(cfg)
        return cls(
            embedding_multiplier=_finite(cfg, "embedding_multiplier"),
            residual_multiplier=_finite(cfg, "residual_multiplier"),
            attention_multiplier=_finite(cfg, "attention_multiplier"),
            logits_scaling=_finite(cfg, "logits_scaling", positive=True),
        )


def check_olmo2(cfg: dict[str, Any]) -> None:
    """OLMo 2's fields the model class reads beyond the common ones: its MLP's (hidden_act,
    transformers' default silu); a ValueError naming the field it cannot run."""
    require_plain_gated_mlp(filled(cfg, "olmo2"))


def check_granite(cfg: dict[str, Any]) -> None:
    """Granite's fields parsed as GraniteConfig.from_hf parses them (a ValueError naming the
    field it refuses)."""
    GraniteConfig.from_hf(cfg)
