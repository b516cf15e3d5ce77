"""Rotary angles per position for each rope scaling type, as transformers 5.24 computes them
(transformers/modeling_rope_utils.py), in float64.

transformers picks two types' frequencies from the sequence length of each forward call.
LongRoPE takes the long factors when the call's highest position + 1 exceeds the original
context; Phi-3's generate() then drops its KV cache and re-encodes the whole sequence with them,
because keys rotated by both factor sets in one cache break attention (transformers PR 33129).
The engine builds both tables (RotaryEmbedding: short rows, then long rows at long_offset) and
chooses per request as transformers does: the engine core flags a request long once its tokens
exceed the original context and recomputes one that crosses it (engine_core/scheduler.py).

Dynamic NTK recomputes the base for each call's length once past max_position_embeddings,
keeping the keys already cached (transformers does not re-encode). The table gives position p
the base for length max(p + 1, max_position_embeddings): transformers' own result for a prompt
within the context and every token generated after it one by one; a prompt that starts beyond
gets, at its first positions, the base of their own length where transformers uses the
prompt's. Keys depend only on their position: the prefix cache and CUDA graphs stay valid and
batching cannot change a result. docs/models/rope-scaling.md says more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from config.rope_arch import rope_type


def _linear(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Positions interpolated by `factor`: every frequency divided by it."""
    return inv_freq / float(scaling["factor"])


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's (as transformers' _compute_yarn_parameters): frequencies that turn fewer than
    beta_slow times over the original context divided by `factor`, those turning more than
    beta_fast times kept, a linear ramp over the dimensions between. The cos/sin scale that
    goes with it is yarn_attention_factor's."""
    dim, theta = 2 * inv_freq.numel(), float(scaling["rope_theta"])
    factor = _yarn_factor(scaling)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    old_len = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of the unscaled frequency
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def _yarn_factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the new context to the original
        factor = scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return float(factor)


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' attention_factor): the config's
    attention_factor, else 0.1 * ln(factor) + 1 (or the ratio of that with mscale over that with
    mscale_all_dim, where both are given), 1 for factor <= 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """LongRoPE's cos/sin scale (transformers' _compute_longrope_parameters): attention_factor,
    else sqrt(1 + ln(factor) / ln(original context)) with factor the config's or the ratio of
    max_position_embeddings to the original context, 1 for factor <= 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(scaling["max_position_embeddings"]) / old_len if factor is None else factor
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(old_len))


# The position-independent variants (config.json's rope_type): the default frequencies rescaled.
ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.float64) / dim


def _longrope(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[dim / 2] frequencies, each divided by its factor: long_factor's where long_context
    (RotaryEmbedding builds both; absent: where the config's max_position_embeddings passes the
    original context), short_factor's otherwise (module docstring)."""
    long = scaling.get("long_context")
    if long is None:
        long = scaling["max_position_embeddings"] > scaling["original_max_position_embeddings"]
    name = "long_factor" if long else "short_factor"
    for which in ("short_factor", "long_factor"):
        if len(scaling[which]) != dim // 2:
            raise ValueError(
                f"rope scaling longrope: {which} has {len(scaling[which])} entries, the {dim} "
                f"rotary dims need {dim // 2}"
            )
    factors = torch.tensor(scaling[name], dtype=torch.float64)
    return 1.0 / (factors * theta ** _exponents(dim))


def _dynamic(positions: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> Any:
    """[P, dim / 2] frequencies of dynamic NTK: the base transformers computes for a sequence of
    max(p + 1, max_position_embeddings) tokens (module docstring)."""
    factor, old_len = float(scaling["factor"]), float(scaling["max_position_embeddings"])
    length = torch.clamp(positions + 1, min=old_len)
    base = theta * ((factor * length / old_len) - (factor - 1)) ** (dim / (dim - 2))
    return base[:, None] ** -_exponents(dim)[None, :]


def rotary_angles(
    rows: int, dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """Angles [rows, dim / 2] in float64 of positions 0..rows-1 for the first `dim` dims of a
    head, and the factor cos and sin are multiplied by (YaRN's and LongRoPE's attention
    factor, else 1). scaling carries max_position_embeddings (the config's) and rope_theta."""
    positions = torch.arange(rows, dtype=torch.float64)
    inv_freq = theta ** -_exponents(dim)
    if scaling is None:
        return torch.outer(positions, inv_freq), 1.0
    kind = rope_type(scaling)
    if kind == "longrope":
        return torch.outer(positions, _longrope(dim, theta, scaling)), longrope_attention_factor(
            scaling
        )
    if kind == "dynamic":
        return positions[:, None] * _dynamic(positions, dim, theta, scaling), 1.0
    rescale = ROPE_SCALINGS.get(kind)
    if rescale is None:
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    magnitude = yarn_attention_factor(scaling) if kind == "yarn" else 1.0
    return torch.outer(positions, rescale(inv_freq, scaling)), magnitude
