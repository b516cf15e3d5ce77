"""The rotate-half rotary embedding as a Triton kernel, rotary_ (kernels/rotary.py says what it
computes), one program per token. Imported only where it runs: on CUDA, and in the tests under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def _check_table(t: torch.Tensor, name: str, x: torch.Tensor, rotary_dim: int) -> None:
    tokens = x.shape[0]
    assert t.dtype in _DTYPES, f"{name} dtype {t.dtype} is not one of {_DTYPES}"
    assert t.device == x.device, f"{name} is on {t.device}, x on {x.device}"
    assert t.shape in ((tokens, 1, rotary_dim), (tokens, rotary_dim)), (
        f"{name} shape {tuple(t.shape)} is neither [T, 1, R] nor [T, R] for x {tuple(x.shape)}"
    )
    assert t.stride(-1) == 1, f"{name}'s last dim must be contiguous"


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by the per-token tables cos/sin [T, 1, R]
    (or [T, R]; sin's first half negated), in fp32; returns x. R, the rotary_dim, is even and at
    most head_dim: each head's first R dims turn, the rest are left as they are (partial rotary).

    x may be strided over tokens and heads (q and k sliced out of a qkv projection) but its
    head_dim axis must be contiguous; the tables may be fp32 or 16-bit."""
    assert x.dim() == 3, f"x must be [T, heads, head_dim], got {tuple(x.shape)}"
    tokens, heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    assert x.dtype in _DTYPES, f"x dtype {x.dtype} is not one of {_DTYPES}"
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, (
        f"rotary_dim {rotary_dim} must be even and within head_dim {head_dim}"
    )
    assert x.stride(2) == 1, "x's head_dim axis must be contiguous"
    _check_table(cos, "cos", x, rotary_dim)
    _check_table(sin, "sin", x, rotary_dim)
    if tokens == 0 or heads == 0:
        return x
    half = rotary_dim // 2
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
