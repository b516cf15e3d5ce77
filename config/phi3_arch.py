"""Phi3ForCausalLM's own config.json fields, checked when the configuration resolves
(config/family_arch.py): what gpu_worker/models/phi3.py builds, refused in one line otherwise."""

from __future__ import annotations

from typing import Any

from config.rope_arch import rope_scaling, rope_type, rotary_dim


def check_phi3(cfg: dict[str, Any]) -> None:
    """ValueError naming the field when the model class cannot build this Phi-3: an activation
    other than SiLU, a partial_rotary_factor that gives no even rotary width, LongRoPE factor
    lists that do not cover the rotary dims, or a rope type Phi3Config refuses."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json's hidden_act {act!r}: Phi-3's gated MLP is SiLU only")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    dim = rotary_dim(cfg, head_dim)
    scaling = rope_scaling(cfg)
    if scaling is None:
        return
    kind = rope_type(scaling)
    if kind != "longrope":
        raise ValueError(f"config.json's rope scaling {kind!r}: Phi3Config takes longrope only")
    for name in ("short_factor", "long_factor"):
        if len(scaling[name]) != dim // 2:
            raise ValueError(
                f"config.json's rope scaling {name} has {len(scaling[name])} entries; "
                f"{dim} rotary dims need {dim // 2}"
            )
