"""RMSNorm's Triton kernels (kernels/rms_norm.py says what they compute): rms_norm and
add_rms_norm, one program per row. Imported only where they run: on CUDA, and in the tests under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widest row one program normalises in registers (Llama-3-70B's hidden size is 8192).
MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    weight_ptr,
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    stride_oo,
    stride_oi,
    inner,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Row r is (r // inner, r % inner) of the [outer, inner, n_cols] view; int64 so that large
    # activations (> 2**31 elements) do not overflow the address math.
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    idx = row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + outer * stride_xo + idx * stride_xi + offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + outer * stride_ro + idx * stride_ri + offs
        r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual's dtype before normalising it, as the torch path does
        # (residual = x + residual, then the norm of that).
        s = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(res_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(
        out_ptr + outer * stride_oo + idx * stride_oi + offs,
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _num_warps(block: int) -> int:
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> None:
    n_cols = x.shape[-1]
    assert x.dtype in _DTYPES, f"x dtype {x.dtype} is not one of {_DTYPES}"
    assert weight.dtype in _DTYPES, f"weight dtype {weight.dtype} is not one of {_DTYPES}"
    assert weight.shape == (n_cols,), (
        f"weight shape {tuple(weight.shape)} != ({n_cols},), x's last dim"
    )
    assert weight.stride(0) == 1 or n_cols == 1, "weight must be contiguous"
    assert 0 < n_cols <= MAX_HIDDEN, f"hidden size {n_cols} outside (0, {MAX_HIDDEN}]"
    assert out.shape == x.shape, f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}"
    for t, name in ((weight, "weight"), (out, "out"), (residual, "residual")):
        if t is not None:
            assert t.device == x.device, f"{name} is on {t.device}, x on {x.device}"
    outer, inner, sxo, sxi = _rows(x, "x")
    _, _, soo, soi = _rows(out, "out")
    sro, sri = 0, 0
    if residual is not None:
        assert residual.shape == x.shape, (
            f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )
        assert residual.dtype == x.dtype, f"residual dtype {residual.dtype} != x dtype {x.dtype}"
        _, _, sro, sri = _rows(residual, "residual")
    if outer * inner == 0:
        return
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(outer * inner,)](
        x,
        x if residual is None else residual,
        out,
        weight,
        sxo,
        sxi,
        sro,
        sri,
        soo,
        soi,
        inner,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x / sqrt(mean(x**2, -1) + eps) * weight in fp32, stored in x's dtype (or out's).

    x: [..., hidden] with a contiguous last dim and leading dims that view as at most two (rows
    may be strided, e.g. heads sliced out of a qkv projection); weight: [hidden], fp32 or 16-bit.
    Returns out (a new contiguous tensor shaped like x when out is None)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, out, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (rounded to residual's dtype); returns (rms_norm(residual) *
    weight, residual), like add_rms_norm_cpu. The norm is of the rounded sum, as
    the torch path computes it."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, out, weight, eps)
    return out, residual


def _rows(t: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(outer, inner, outer stride, inner stride) of t's rows seen as [outer, inner, n_cols]."""
    assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name}'s last dim must be contiguous"
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    try:
        view = t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError as e:
        raise AssertionError(f"{name}'s leading dims {tuple(t.shape[:-2])} do not flatten") from e
    return view.shape[0], view.shape[1], view.stride(0), view.stride(1)
