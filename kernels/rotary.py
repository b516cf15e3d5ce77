"""The rotate-half rotary embedding, in place on q and k: the Triton kernel rotary_
(kernels/triton/rotary.py), and rotary_cpu_ here, the C kernel (kernels/cpu/rotary.c) for fp32
CPU tensors.

The torch path (x * cos + cat(x2, x1) * sin, then a copy back into x) costs a decode step five
kernels and three temporaries per layer; here one program per token rotates all of the token's
heads as one [heads, head_dim / 2] tile per half, in fp32, and stores back into x. x is usually a
strided view: q and k sliced out of the qkv projection's output, so tokens are qkv rows apart.

Tables are RotaryEmbedding.cos_sin's: cos and sin [T, 1, R] (or [T, R]) with sin's first half
negated, R the rotary_dim (head_dim, or fewer under Phi's partial rotary: the head's dims from R on
pass through), so over x's first R dims out = x * cos + cat(x2, x1) * sin, i.e. per half
out1 = x1 * cos1 + x2 * sin1 and out2 = x2 * cos2 + x1 * sin2.
No host syncs and no data-dependent sizes: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, check_rows, library


def fits(x: torch.Tensor) -> bool:
    """Whether rotary_ takes x: [T, heads, head_dim], head_dim even and contiguous."""
    return x.dim() == 3 and x.shape[2] % 2 == 0 and x.stride(2) == 1


def rotary_cpu_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding in place on x [T, H, D] (heads packed; tokens any stride)
    with per-token tables cos/sin [T, R] (or [T, 1, R]) whose sin has its first half negated:
    the first R (rotary_dim, even, <= D) dims of each head turn, the rest are left as they are
    (Phi's partial rotary)."""
    for t, name in ((x, "x"), (cos, "cos"), (sin, "sin")):
        check_cpu(t, name)
    check_rows(x, "x")
    tokens, heads, head_dim = x.shape
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if (
        not (cos.is_contiguous() and sin.is_contiguous())
        or rotary_dim % 2
        or not 0 < rotary_dim <= head_dim
        or cos.numel() != tokens * rotary_dim
        or sin.shape != cos.shape
    ):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    library().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        head_dim,
        rotary_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return x


def qk_norm_rotary_cpu_(
    x: torch.Tensor,
    q_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Per-head RMSNorm (q_weight over the first q_heads heads, k_weight over the rest), then
    rotary_cpu_'s rotation, in place on x [T, q_heads + k_heads, D]; returns x."""
    for t, name in ((q_weight, "q_weight"), (k_weight, "k_weight")):
        check_cpu(t, name)
        if t.shape != x.shape[-1:] or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} is not a packed [{x.shape[-1]}]")
    if not 0 <= q_heads <= x.shape[1]:
        raise ValueError(f"q_heads {q_heads} out of range for x {tuple(x.shape)}")
    for t, name in ((x, "x"), (cos, "cos"), (sin, "sin")):
        check_cpu(t, name)
    check_rows(x, "x")
    tokens, heads, head_dim = x.shape
    if (
        not (cos.is_contiguous() and sin.is_contiguous())
        or cos.numel() != tokens * head_dim
        or sin.shape != cos.shape
    ):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    library().qk_norm_rotary_f32(
        x.data_ptr(),
        x.stride(0),
        tokens,
        q_heads,
        heads - q_heads,
        head_dim,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        eps,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return x
