"""SwiGLU's silu_and_mul as a Triton kernel (kernels/activation.py says what it computes), on
a (rows, column blocks) grid. Imported only where it runs: on CUDA, and in the tests under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Columns per program on the device.
_BLOCK = 1024
# The interpreter's cost is mostly per op and per program, not per element: larger blocks run
# tests faster.
_INTERPRETER_BLOCK = 8192


@triton.jit
def _silu_and_mul_kernel(
    y_ptr,
    out_ptr,
    stride_yr,
    stride_or,
    n_cols,
    BLOCK: tl.constexpr,
):
    # int64 so that large activations (> 2**31 elements) do not overflow the address math.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate_ptrs = y_ptr + row * stride_yr + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_or + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y [..., 2I] = [gate | up], in fp32, returned as a new contiguous
    [..., I] tensor in y's dtype. Rows may be strided; the last dim must be contiguous."""
    assert y.dim() >= 1, "y must have a feature dim"
    assert y.dtype in _DTYPES, f"y dtype {y.dtype} is not one of {_DTYPES}"
    assert y.shape[-1] % 2 == 0, f"y's last dim {y.shape[-1]} must be even ([gate | up])"
    assert y.stride(-1) == 1, "y's last dim must be contiguous"
    width = y.shape[-1] // 2
    out = torch.empty((*y.shape[:-1], width), dtype=y.dtype, device=y.device)
    if y.dim() == 1:
        rows, stride = 1, 0
    elif y.dim() == 2:
        rows, stride = y.shape[0], y.stride(0)
    else:
        try:
            flat = y.view(-1, y.shape[-1])
        except RuntimeError as e:
            raise AssertionError(f"y's leading dims {tuple(y.shape[:-1])} do not flatten") from e
        rows, stride = flat.shape[0], flat.stride(0)
    if rows == 0 or width == 0:
        return out
    cap = _BLOCK if y.device.type == "cuda" else _INTERPRETER_BLOCK
    block = min(cap, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        y,
        out,
        stride,
        width,
        width,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )
    return out
