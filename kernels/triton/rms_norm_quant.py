"""RMSNorm (with the residual add) fused with the FP8 W8A8 activation quantization of the
projection it feeds (gpu_worker/layers/fp8_linear.py: Fp8LinearMethod.norm_and_quantize).

One program per row, the row in registers: residual += x in place (rounded to residual's dtype),
y = norm(residual) * weight rounded to x's dtype (what kernels/triton/rms_norm.py's add_rms_norm
returns), then y quantized as kernels/triton/fp8_quant.py's quantize_per_token does (scale =
amax / 448 at least MIN_SCALE, or a static scale; IEEE division; the e4m3 byte by integer
arithmetic). It writes the residual, the fp8 codes and the row's scale: the normed activations
never go to memory, and one launch replaces two. Under the interpreter the bytes and scales equal
add_rms_norm then quantize_per_token exactly; compiled, the sum of squares is reduced in the
same block shape and warp count as add_rms_norm's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_weights import FP8_MAX
from kernels.triton.fp8_quant import MIN_SCALE
from kernels.triton.rms_norm import MAX_HIDDEN, _num_warps
from kernels.triton.write_kv import e4m3_bits

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    stride_x,
    stride_r,
    stride_q,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * stride_r + offs
        r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(residual_ptr.dtype.element_ty)  # the rounded sum, as add_rms_norm
        tl.store(res_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the activations' dtype, as the unfused norm's output is before its quantizer.
    y = (x * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        # div_rn: IEEE division, as torch (plain / is an approximation on CUDA)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + offs, e4m3_bits(q).to(tl.uint8), mask=mask)


def rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q float8_e4m3fn [M, K], scale fp32 [M, 1]) of
    add_rms_norm(x, residual, weight, eps)'s output (rms_norm(x)'s where residual is None),
    quantized per row as quantize_per_token(y, static_scale) does. residual [M, K] (x's dtype)
    becomes x + residual in place."""
    if x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1):
        raise ValueError(f"x must be [M, K] with unit column stride, not {tuple(x.shape)}")
    m, k = x.shape
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"dtypes x {x.dtype}, weight {weight.dtype}: not one of {_DTYPES}")
    if weight.shape != (k,) or (weight.stride(0) != 1 and k > 1):
        raise ValueError(f"weight {tuple(weight.shape)} is not a contiguous [{k}]")
    if not 0 < k <= MAX_HIDDEN:
        raise ValueError(f"hidden size {k} outside (0, {MAX_HIDDEN}]")
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype != x.dtype
        or (residual.stride(1) != 1 and k > 1)
    ):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
            f"{tuple(x.shape)} {x.dtype} (unit column stride)"
        )
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _rms_norm_quant_kernel[(m,)](
        x,
        x if residual is None else residual,
        weight,
        q.view(torch.uint8),
        scale,
        scale if static_scale is None else static_scale,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        q.stride(0),
        k,
        eps,
        HAS_RESIDUAL=residual is not None,
        STATIC=static_scale is not None,
        FP8_MAX_C=FP8_MAX,
        MIN_SCALE_C=MIN_SCALE,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return q, scale
