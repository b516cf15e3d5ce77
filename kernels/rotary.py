"""The rotate-half rotary embedding, in place on q and k: the Triton kernel rotary_, and beside
it rotary_cpu_, the C kernel (kernels/cpu/rotary.c) for fp32 CPU tensors.

The torch path (x * cos + cat(x2, x1) * sin, then a copy back into x) costs a decode step five
kernels and three temporaries per layer; here one program per token rotates all of the token's
heads as one [heads, head_dim / 2] tile per half, in fp32, and stores back into x. x is usually a
strided view: q and k sliced out of the qkv projection's output, so tokens are qkv rows apart.

Tables are RotaryEmbedding.cos_sin's: cos and sin [T, 1, head_dim] (or [T, head_dim]) with sin's
first half negated, so out = x * cos + cat(x2, x1) * sin, i.e. per half
out1 = x1 * cos1 + x2 * sin1 and out2 = x2 * cos2 + x1 * sin2.
No host syncs and no data-dependent sizes: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cpu_binding import check_cpu, check_rows, library

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 so that large activations (> 2**31 elements) do not overflow the address math.
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    mask = (h[:, None] < heads) & d_mask[None, :]

    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    cos1 = tl.load(cos_row + d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)

    x1_ptrs = x_ptr + token * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x2_ptrs = x1_ptrs + HALF
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1[None, :] + x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(x1_ptrs, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x2_ptrs, out2.to(x_ptr.dtype.element_ty), mask=mask)


def _check_table(t: torch.Tensor, name: str, x: torch.Tensor) -> None:
    tokens, _, head_dim = x.shape
    assert t.dtype in _DTYPES, f"{name} dtype {t.dtype} is not one of {_DTYPES}"
    assert t.device == x.device, f"{name} is on {t.device}, x on {x.device}"
    assert t.shape in ((tokens, 1, head_dim), (tokens, head_dim)), (
        f"{name} shape {tuple(t.shape)} is neither [T, 1, D] nor [T, D] for x {tuple(x.shape)}"
    )
    assert t.stride(-1) == 1, f"{name}'s last dim must be contiguous"


def fits(x: torch.Tensor) -> bool:
    """Whether rotary_ takes x: [T, heads, head_dim], head_dim even and contiguous."""
    return x.dim() == 3 and x.shape[2] % 2 == 0 and x.stride(2) == 1


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by the per-token tables cos/sin [T, 1, head_dim]
    (or [T, head_dim]; sin's first half negated), in fp32; returns x.

    x may be strided over tokens and heads (q and k sliced out of a qkv projection) but its
    head_dim axis must be contiguous; the tables may be fp32 or 16-bit."""
    assert x.dim() == 3, f"x must be [T, heads, head_dim], got {tuple(x.shape)}"
    tokens, heads, head_dim = x.shape
    assert x.dtype in _DTYPES, f"x dtype {x.dtype} is not one of {_DTYPES}"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert x.stride(2) == 1, "x's head_dim axis must be contiguous"
    _check_table(cos, "cos", x)
    _check_table(sin, "sin", x)
    if tokens == 0 or heads == 0 or head_dim == 0:
        return x
    half = head_dim // 2
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(half)
    _rotary_kernel[(tokens,)](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
    return x


def rotary_cpu_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding in place on x [T, H, D] (heads packed; tokens any stride)
    with per-token tables cos/sin [T, D] (or [T, 1, D]) whose sin has its first half negated."""
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
    library().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return x
