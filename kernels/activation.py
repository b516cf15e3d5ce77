"""SwiGLU's activation, silu(gate) * up, for the fused gate/up projection's output: the Triton
kernel silu_and_mul (kernels/triton/activation.py), and silu_and_mul_cpu here, the C kernel
(kernels/cpu/activation.c) for fp32 CPU tensors.

The torch path (chunk, F.silu, mul) costs a decode step two kernels and a temporary per layer;
here one pass reads y = [gate | up] and writes silu(gate) * up in y's dtype, computing in fp32.
The grid is (rows, column blocks), so a wide intermediate (14336 for Llama-3-8B) spreads over
many programs even at batch 1.
No host syncs and no data-dependent sizes: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, library


def fits(y: torch.Tensor) -> bool:
    """Whether silu_and_mul takes y: [..., 2I] with a contiguous last dim and leading dims that
    view as one."""
    if y.dim() == 0 or y.shape[-1] % 2 or y.stride(-1) != 1:
        return False
    if y.dim() <= 2:
        return True
    try:
        y.view(-1, y.shape[-1])
    except RuntimeError:
        return False
    return True


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :w]) * x[..., w:] for x [..., 2w]; returns a new [..., w] tensor."""
    check_cpu(x, "x")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    out = torch.empty(*x.shape[:-1], width)
    library().silu_and_mul_f32(
        rows.data_ptr(),
        rows.stride(0),
        out.data_ptr(),
        width,
        rows.shape[0],
        width,
        torch.get_num_threads(),
    )
    return out
