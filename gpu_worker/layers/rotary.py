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


# The rope_scaling variants (config.json's rope_type): the default frequencies rescaled.
ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "linear": _linear,
    "llama3": _llama3,
}


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    rescale = ROPE_SCALINGS.get(str(scaling.get("rope_type", scaling.get("type"))))
    if rescale is None:
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    return rescale(inv_freq, scaling)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at given positions, from a precomputed table."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float64), _inv_freq(head_dim, theta, scaling)
        )
        emb = torch.cat([freqs, freqs], dim=-1)
        self.half = head_dim // 2
        sin = emb.sin()
        sin[:, : self.half] *= -1  # folds rotate-half's negation into the table
        self.register_buffer("cos", emb.cos().float(), persistent=False)
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
        kernels/rotary.py on CUDA); returns x."""
        if cpu_binding.applies(x) and x.stride(1) == x.shape[2] and x.stride(2) == 1:
            return rotary.rotary_cpu_(x, cos, sin)
        if x.device.type == "cuda":
            if rotary.fits(x):
                return rotary.rotary_(x, cos, sin)
        x.copy_(self.apply(x, cos, sin))
        return x
