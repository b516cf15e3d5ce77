"""Activations quantized to float8 e4m3 for an FP8 W8A8 matmul (gpu_worker/layers/fp8_linear.py):
a scale per token (row), amax / 448, computed on the device, or a checkpoint's static scale.

One program per row: a pass for the row's amax, a pass writing x / scale clamped to +-448 and
rounded to e4m3. The scales stay on the device ([M, 1] fp32, what torch._scaled_mm's rowwise
scaling reads), so no host sync, and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_weights import FP8_MAX
from kernels.triton.write_kv import e4m3_bits

# The smallest per-token scale: an all-zero row quantizes to zeros, not NaN (vLLM's floor).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        # div_rn: IEEE division, as torch (plain / is an approximation on CUDA)
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        # The e4m3 byte by integer arithmetic: the interpreter's own conversion rounds otherwise.
        tl.store(q_ptr + row * stride_qm + k0 + cols, e4m3_bits(q).to(tl.uint8), mask=mask)


def quantize_per_token(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, unit column stride) -> (q float8_e4m3fn [M, K], scale fp32
    [M, 1]) with x ~= q * scale: each row's amax / 448 (at least MIN_SCALE), or static_scale (a
    one-element fp32 tensor) for every row."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], not {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(triton.next_power_of_2(k), 4096 if x.device.type == "cuda" else 16384)
    _quantize_rows_kernel[(m,)](
        x,
        q.view(torch.uint8),
        scale,
        scale if static_scale is None else static_scale,
        k,
        x.stride(0),
        q.stride(0),
        STATIC=static_scale is not None,
        FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=MIN_SCALE,
        BLOCK_K=block_k,
        num_warps=8 if block_k >= 4096 else 4,
    )
    return q, scale


def quantize_per_token_reference(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (the tests' reference)."""
    xf = x.to(torch.float32)
    if static_scale is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()
