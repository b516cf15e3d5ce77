"""RMSNorm, optionally fused with the residual add that precedes it: the Triton kernels
rms_norm and add_rms_norm (kernels/triton/rms_norm.py), and add_rms_norm_cpu here, the C kernel
(kernels/cpu/rms_norm.c) for fp32 CPU tensors.

The generic torch path costs a decode step five or six tiny kernels per norm (the fp32 casts of
x and of the weight, the norm itself, the cast back and a separate residual add); here one
program per row reads the row once, adds the residual (writing the sum back in place), reduces
and normalises in fp32, and stores the result in x's dtype. The weight is read in its own dtype
and upcast in the kernel, so no cast runs per call.

Rows are the leading dims of x: [N, hidden], or [T, heads, head_dim] for per-head q/k norms,
where the heads of a token are packed but tokens may be a strided slice of a wider projection.
No host syncs and no data-dependent sizes: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, library


def flattens(t: torch.Tensor) -> bool:
    """Whether rms_norm takes t as it is: last dim contiguous, leading dims viewable as two."""
    if t.dim() == 0 or (t.stride(-1) != 1 and t.shape[-1] != 1):
        return False
    if t.dim() <= 3:
        return True
    try:
        t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return False
    return True


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place; returns (rms_norm(residual) * weight, residual)."""
    for t, name in ((x, "x"), (residual, "residual"), (weight, "weight")):
        check_cpu(t, name)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    out = torch.empty_like(x)
    width = x.shape[-1]
    library().add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        x.numel() // width if width else 0,
        width,
        eps,
        torch.get_num_threads(),
    )
    return out, residual
