"""Rotary position embedding (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernels import cpu_binding, rotary


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


# The rope_scaling variants (config.json's rope_type): the default frequencies rescaled.
ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def _rope_type(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type")))


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    rescale = ROPE_SCALINGS.get(_rope_type(scaling))
    if rescale is None:
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope scaling {scaling!r}: partial_rotary_factor is not supported")
    # YaRN's ramp reads the base and the context length (RotaryEmbedding adds the latter).
    return rescale(inv_freq, {**scaling, "rope_theta": theta})


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at given positions, from a precomputed table."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if scaling is not None:
            scaling = {**scaling, "max_position_embeddings": max_positions}
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float64), _inv_freq(head_dim, theta, scaling)
        )
        emb = torch.cat([freqs, freqs], dim=-1)
        self.head_dim = head_dim
        # The leading dims of each head that rotate (all here; Phi's partial_rotary_factor less).
        self.rotary_dim = head_dim
        self.half = head_dim // 2
        # YaRN scales cos and sin (so q.k by its square); the kernels take the tables as they are.
        cos, sin = emb.cos(), emb.sin()
        if scaling is not None and _rope_type(scaling) == "yarn":
            magnitude = yarn_attention_factor(scaling)
            cos *= magnitude
            sin *= magnitude
        sin[:, : self.half] *= -1  # folds rotate-half's negation into the table
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token [T, 1, head_dim] tables; computed once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated copy."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return x * cos + torch.cat((x2, x1), dim=-1) * sin

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] in place (one fused pass in fp32: the C kernel on the CPU,
        kernels/triton/rotary.py on CUDA); returns x."""
        if cpu_binding.applies(x) and x.stride(1) == x.shape[2] and x.stride(2) == 1:
            return rotary.rotary_cpu_(x, cos, sin)
        if x.device.type == "cuda":
            if rotary.fits(x):
                from kernels.triton.rotary import rotary_

                return rotary_(x, cos, sin)
        x.copy_(self.apply(x, cos, sin))
        return x

    def fuses_qk_norm(self, x: torch.Tensor) -> bool:
        """Whether qk_norm_apply_ runs in one C kernel on x [T, heads, head_dim]: fp32 CPU tensors
        with the kernels built and each token's heads packed."""
        return cpu_binding.applies(x) and x.stride(1) == x.shape[2] and x.stride(2) == 1

    def qk_norm_apply_(
        self,
        x: torch.Tensor,
        q_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Per-head RMSNorm of q (x's first q_heads heads, q_weight) and k (the rest, k_weight)
        then the rotation, in place on x in one pass (where fuses_qk_norm); returns x."""
        return rotary.qk_norm_rotary_cpu_(x, q_heads, q_weight, k_weight, eps, cos, sin)
