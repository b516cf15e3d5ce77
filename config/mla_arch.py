"""The attention fields of a DeepSeek-V2/V3 config.json: multi-head latent attention's ranks
and head sizes (gpu_worker/models/deepseek_mla.py builds the block from them), parsed without
torch so that the configuration refuses what the engine cannot run when it resolves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from config.hf_defaults import filled


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """The attention fields of a DeepSeek-V2/V3 config.json."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is projected from x directly (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The rotary pairs are adjacent elements (x0, x1), (x2, x3), ... (V2 always; V3 unless
    # rope_interleave is false), not the two halves.
    rope_interleave: bool = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], interleave_default: bool = True) -> MLAConfig:
        """Parse config.json (transformers' defaults for its model_type where a field is left
        out); ValueError naming a missing or invalid field."""
        cfg = filled(cfg)
        fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        values = {}
        for name in fields:
            value = cfg.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, not {value!r}")
            values[name] = value
        if values["qk_rope_head_dim"] % 2:
            raise ValueError("config.json: qk_rope_head_dim must be even (rotary pairs)")
        q_lora_rank = cfg.get("q_lora_rank")
        if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank < 1):
            raise ValueError(
                f"config.json: q_lora_rank must be a positive integer or null, not {q_lora_rank!r}"
            )
        interleave = cfg.get("rope_interleave")
        return cls(
            q_lora_rank=q_lora_rank,
            rope_interleave=interleave_default if interleave is None else bool(interleave),
            **values,
        )

    def softmax_scale(self, rope_scaling: dict[str, Any] | None) -> float:
        """1/sqrt(qk_nope + qk_rope), times mscale^2 under a scaled rope with mscale_all_dim
        (YaRN as DeepSeek-V3 ships it: 0.1 * mscale_all_dim * ln(factor) + 1), as transformers'
        yarn_apply_mscale."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if rope_scaling is None:
            return scale
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        factor = float(rope_scaling.get("factor") or 1.0)
        if rope_type == "default" or not mscale_all_dim or factor <= 1:
            return scale
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        return scale * mscale * mscale
