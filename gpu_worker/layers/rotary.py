"""Rotary position embedding (the rotate-half layout Hugging Face Llama checkpoints use)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from config.rope_arch import rope_context_len, rope_type
from gpu_worker.layers.rope_scaling import (
    ROPE_SCALINGS,
    longrope_attention_factor,
    rotary_angles,
    yarn_attention_factor,
)
from kernels import cpu_binding, rotary

__all__ = [
    "ROPE_SCALINGS",
    "RotaryEmbedding",
    "longrope_attention_factor",
    "yarn_attention_factor",
]


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at given positions, from a precomputed table.

    The first rotary_dim dims of each head rotate (rotate-half within them); the rest pass
    through unchanged (Phi's partial_rotary_factor). The tables hold one row per position up to
    the context the scaling extends the model to (config/rope_arch.py rope_context_len)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        """max_positions: the config's max_position_embeddings (which dynamic NTK, LongRoPE and
        YaRN without a factor read); rotary_dim: head_dim unless given."""
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and within head_dim {head_dim}")
        if scaling is not None:
            partial = float(scaling.get("partial_rotary_factor", rotary_dim / head_dim))
            if int(head_dim * partial) != rotary_dim:
                raise ValueError(
                    f"rope scaling {scaling!r}: partial_rotary_factor {partial} does not give "
                    f"the {rotary_dim} rotary dims of this model's {head_dim}-dim heads"
                )
            # The rules read the base and the config's context length (transformers' config).
            scaling = {**scaling, "max_position_embeddings": max_positions, "rope_theta": theta}
        rows = rope_context_len(max_positions, scaling)
        angles, magnitude = rotary_angles(rows, rotary_dim, theta, scaling)
        # LongRoPE: rows [0, rows) turn with the short factors, [rows, 2 * rows) with the long
        # ones; a long request's positions come offset by long_offset (the model runner adds
        # it), so one batch mixes both without a host wait (transformers picks per sequence).
        self.long_offset = 0
        if scaling is not None and rope_type(scaling) == "longrope":
            short = rotary_angles(rows, rotary_dim, theta, {**scaling, "long_context": False})
            long = rotary_angles(rows, rotary_dim, theta, {**scaling, "long_context": True})
            angles, magnitude, self.long_offset = torch.cat([short[0], long[0]]), short[1], rows
        self.head_dim = head_dim
        # The leading dims of each head that rotate (Phi's partial_rotary_factor: fewer).
        self.rotary_dim = rotary_dim
        self.half = rotary_dim // 2
        # YaRN and LongRoPE scale cos and sin (so q.k by the square); the kernels take the
        # tables as they are. Both halves of a row share their angles: computed once.
        cos, sin = (angles.cos() * magnitude).float(), (angles.sin() * magnitude).float()
        # sin's first half negated folds rotate-half's negation into the table.
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token [T, 1, head_dim] tables; computed once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated copy (the first rotary_dim dims of each head turn,
        the rest are copied)."""
        if self.rotary_dim != x.shape[-1]:
            turned = self.apply(x[..., : self.rotary_dim], cos, sin)
            return torch.cat((turned, x[..., self.rotary_dim :]), dim=-1)
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
        turning = x[..., : self.rotary_dim]
        turning.copy_(self.apply(turning, cos, sin))
        return x

    def fuses_qk_norm(self, x: torch.Tensor) -> bool:
        """Whether qk_norm_apply_ runs in one C kernel on x [T, heads, head_dim]: fp32 CPU tensors
        with the kernels built and each token's heads packed, every dim rotating (the kernel
        turns whole heads)."""
        packed = x.stride(1) == x.shape[2] and x.stride(2) == 1
        return cpu_binding.applies(x) and packed and self.rotary_dim == self.head_dim

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
