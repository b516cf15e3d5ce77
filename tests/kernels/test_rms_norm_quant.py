"""kernels/triton/rms_norm_quant.py (the residual add, RMSNorm and the per-token FP8 quantizer in
one kernel) against the unfused kernels it replaces: add_rms_norm (or rms_norm) then
quantize_per_token, byte for byte, scales equal, the residual updated alike. On the CPU under the
interpreter (tests/conftest.py), on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.fp8_quant import MIN_SCALE, quantize_per_token
from kernels.triton.rms_norm import add_rms_norm, rms_norm
from kernels.triton.rms_norm_quant import rms_norm_quant


def _inputs(rows: int, k: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 20).to(dtype)
    residual = (torch.randn(rows, k, generator=gen) * 5).to(dtype)
    weight = (torch.rand(k, generator=gen) * 2).to(dtype)
    if rows > 1:
        weight[:3] = torch.tensor([0.0, 40.0, -3.0])  # a zero and a large channel
    return x.to(device), residual.to(device), weight.to(device)


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


# Every dtype and scale kind at 1 to 64 rows; 300 rows (a program each, about 4 s a case under
# the interpreter with the two reference kernels) once per scale kind.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CASES = [
    pytest.param(rows, dtype, static, id=f"{'static' if static else 'per-token'}-{rows}-{dtype}")
    for rows in (1, 3, 16, 64)
    for dtype in _DTYPES
    for static in (False, True)
] + [
    pytest.param(300, torch.float32, False, id="per-token-300-fp32"),
    pytest.param(300, torch.bfloat16, True, id="static-300-bf16"),
]


@pytest.mark.parametrize(("rows", "dtype", "static"), _CASES)
def test_fused_equals_norm_then_quantize(rows, dtype, static, device: torch.device) -> None:
    k = 96 if rows == 300 else 1000  # 1000: a block wider than the row (masked tail)
    x, residual, weight = _inputs(rows, k, dtype, device)
    static_scale = torch.tensor([0.03], device=device) if static else None
    ref_residual = residual.clone()
    y, _ = add_rms_norm(x, ref_residual, weight, 1e-5)
    ref_q, ref_scale = quantize_per_token(y, static_scale)
    q, scale = rms_norm_quant(x, residual, weight, 1e-5, static_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, k) and scale.shape == (rows, 1)
    assert torch.equal(residual.cpu(), ref_residual.cpu())  # x + residual, in place
    assert torch.equal(scale.cpu(), ref_scale.cpu())
    assert torch.equal(_bytes(q), _bytes(ref_q))
    assert _bytes(q).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_residual_and_strided_rows(dtype, device: torch.device) -> None:
    # The first layer's norm: no residual (x is normed and becomes the residual by itself).
    x, _, weight = _inputs(5, 4096, dtype, device)
    before = x.clone()
    q, scale = rms_norm_quant(x, None, weight, 1e-6)
    ref_q, ref_scale = quantize_per_token(rms_norm(x, weight, 1e-6))
    assert torch.equal(x.cpu(), before.cpu())
    assert torch.equal(scale.cpu(), ref_scale.cpu()) and torch.equal(_bytes(q), _bytes(ref_q))
    # Rows with a stride past their width (a view of wider rows), x's and the residual's.
    wide, wide_res, _ = _inputs(4, 160, dtype, device)
    weight = weight[:128].contiguous()
    ref_res = wide_res.clone()
    y, _ = add_rms_norm(wide[:, 16:144], ref_res[:, 8:136], weight, 1e-6)
    ref_q, ref_scale = quantize_per_token(y)
    q, scale = rms_norm_quant(wide[:, 16:144], wide_res[:, 8:136], weight, 1e-6)
    assert torch.equal(wide_res.cpu(), ref_res.cpu())
    assert torch.equal(scale.cpu(), ref_scale.cpu()) and torch.equal(_bytes(q), _bytes(ref_q))


def test_zero_rows_and_all_zero_rows_and_refusals(device: torch.device) -> None:
    weight = torch.ones(64, device=device)
    q, scale = rms_norm_quant(torch.empty(0, 64, device=device), None, weight, 1e-6)
    assert q.shape == (0, 64) and scale.shape == (0, 1)
    zeros = torch.zeros(2, 64, device=device)
    q, scale = rms_norm_quant(zeros, torch.zeros_like(zeros), weight, 1e-6)
    assert torch.equal(scale.cpu(), torch.full((2, 1), MIN_SCALE)) and not _bytes(q).any()
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant(zeros, torch.zeros(2, 64, dtype=torch.bfloat16, device=device), weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(zeros, None, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        rms_norm_quant(zeros.view(2, 8, 8), None, weight, 1e-6)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_projection_takes_the_fused_activation(residual, static, device: torch.device) -> None:
    """Fp8LinearMethod (W8A8, torch's _scaled_mm: on the CPU too) given norm_and_quantize's
    Fp8Activation: the result of the norm's output given to it unquantized, exactly."""
    from gpu_worker.layers.fp8_linear import Fp8Activation, Fp8LinearMethod, fp8_w8a8_supported
    from gpu_worker.layers.linear import Linear
    from gpu_worker.layers.norm import RMSNorm
    from kernels.quant_weights import quantize_fp8

    if device.type == "cuda" and not fp8_w8a8_supported(device):
        pytest.skip("compute capability below 8.9: no FP8 tensor cores")
    gen = torch.Generator().manual_seed(3)
    part = quantize_fp8(torch.randn(96, 256, generator=gen))
    if static:
        part = part._replace(input_scale=torch.tensor(0.04))
    part = part._replace(
        weight=part.weight.to(device),
        scale=part.scale.to(device),
        input_scale=None if part.input_scale is None else part.input_scale.to(device),
    )
    method = Fp8LinearMethod([part], w8a8=True)
    linear = Linear(256, 96)
    linear.use_method(method)
    norm = RMSNorm(256, 1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256, generator=gen) * 2)
    for rows in (1, 3, 16, 64):
        x, res, _ = _inputs(rows, 256, torch.bfloat16, device)
        bias = torch.randn(96, generator=gen).to(torch.bfloat16).to(device)
        ref_res = res.clone()
        if residual:
            y, _ = add_rms_norm(x, ref_res, norm.weight, norm.eps)
        else:
            y, ref_res = rms_norm(x, norm.weight, norm.eps), x
        expected = linear.project(y, bias)
        act, got_res = method.norm_and_quantize(norm, x, res if residual else None)
        assert isinstance(act, Fp8Activation) and act.dtype == torch.bfloat16
        assert torch.equal(got_res.cpu(), ref_res.cpu())
        got = linear.project(act, bias)  # type: ignore[arg-type]
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        assert torch.equal(got.cpu(), expected.cpu())
    empty = method.norm_and_quantize(norm, torch.empty(0, 256, device=device), None)[0]
    assert linear.project(empty, None).shape == (0, 96)  # type: ignore[arg-type]
    weight_only = Fp8LinearMethod([part], w8a8=False)
    with pytest.raises(ValueError, match="W8A8"):
        weight_only.norm_and_quantize(norm, x, None)
    with pytest.raises(ValueError, match="W8A8"):
        weight_only.apply(linear, act, None)
