"""FP8 linear layers on CUDA (gpu_worker/layers/fp8_linear.py): the per-token activation quantizer
(kernels/triton/fp8_quant.py) against torch's conversion, byte for byte; the weight-only path
against x @ Fp8Weight.dequantize().T; the W8A8 path against its math in torch (x quantized per
token, the fp8 products scaled per row and per output feature) — on the CPU through torch's own
_scaled_mm, and on an FP8 GPU (compute capability >= 8.9) through cuBLAS (CUDA-only test).

On the CPU the Triton quantizer runs under the interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.fp8_linear import Fp8LinearMethod, fp8_w8a8_supported
from gpu_worker.layers.linear import Linear
from kernels.quant_weights import Fp8Weight, quantize_fp8
from kernels.triton.fp8_quant import MIN_SCALE, quantize_per_token, quantize_per_token_reference
from tests.kernels.paged_inputs import cuda_only


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1000), (16, 4096), (2, 20000)])
def test_quantizer_is_torchs_conversion(dtype, shape, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 50
    x[0, :7] = torch.tensor([448.0, -1e4, 1e-9, 0.0, -0.0, 3.0, -2.5])  # saturation, tiny values
    x = x.to(dtype)
    q, scale = quantize_per_token(x.to(device))
    ref_q, ref_scale = quantize_per_token_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], 1)
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(_bytes(q), _bytes(ref_q))
    static = torch.tensor([0.05])
    q, scale = quantize_per_token(x.to(device), static.to(device))
    ref_q, ref_scale = quantize_per_token_reference(x, static)
    assert torch.equal(scale.cpu(), ref_scale) and torch.equal(_bytes(q), _bytes(ref_q))


def test_quantizer_zero_rows_and_strided_rows(device: torch.device) -> None:
    x = torch.zeros(2, 96)
    q, scale = quantize_per_token(x.to(device))
    assert torch.equal(scale.cpu(), torch.full((2, 1), MIN_SCALE)) and not _bytes(q).any()
    wide = torch.randn(3, 130)
    q, scale = quantize_per_token(wide.to(device)[:, 1:129])
    ref_q, ref_scale = quantize_per_token_reference(wide[:, 1:129])
    assert torch.equal(scale.cpu(), ref_scale) and torch.equal(_bytes(q), _bytes(ref_q))
    assert quantize_per_token(torch.empty(0, 64, device=device))[0].shape == (0, 64)


def _parts(seed: int, static: bool = False) -> list[Fp8Weight]:
    gen = torch.Generator().manual_seed(seed)
    parts = [quantize_fp8(torch.randn(n, 256, generator=gen)) for n in (64, 32, 32)]
    if static:
        parts = [p._replace(input_scale=torch.tensor(s)) for p, s in zip(parts, (0.02, 0.03, 0.01))]
    return parts


def _on(parts: list[Fp8Weight], device: torch.device) -> list[Fp8Weight]:
    return [
        Fp8Weight(
            p.weight.to(device),
            p.scale.to(device),
            None if p.input_scale is None else p.input_scale.to(device),
        )
        for p in parts
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_is_the_dequantized_weight(dtype, device: torch.device) -> None:
    parts = _parts(0)
    weight = torch.cat([p.dequantize() for p in parts])
    linear = Linear(256, 128, bias=True)
    method = Fp8LinearMethod(_on(parts, device), w8a8=False)
    linear.use_method(method)
    assert not method.w8a8 and method.nbytes(linear) == 128 * 256 * 2
    x, bias = torch.randn(2, 5, 256).to(dtype), torch.randn(128).to(dtype)
    y = linear.project(x.to(device), bias.to(device))
    expected = torch.nn.functional.linear(x, weight.to(dtype), bias)
    assert y.dtype == dtype and y.shape == (2, 5, 128)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert method.dense is not None and method.dense.dtype == dtype and method.weight is None
    with pytest.raises(ValueError, match="not supported"):
        linear.project(x.to(device).to(torch.float16), None)
    built = Fp8LinearMethod(_on(parts, device), w8a8=False, dtype=torch.bfloat16)
    assert built.dense is not None and built.nbytes(linear) == 128 * 256 * 2


def _w8a8_reference(
    x: torch.Tensor, parts: list[Fp8Weight], bias: torch.Tensor | None
) -> torch.Tensor:
    """x quantized per token (or by the largest static scale), times the fp8 weight's values,
    scaled per row and per output feature, in float64; rounded to bf16 as _scaled_mm's out."""
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    rows = x.reshape(-1, x.shape[-1]).cpu()
    q, scale = quantize_per_token_reference(rows, torch.stack(statics).max() if statics else None)
    w = torch.cat([p.weight for p in parts]).cpu().double()
    w_scale = torch.cat([p.scale for p in parts]).cpu().double()
    y = (q.double() @ w.t()) * scale.double() * w_scale
    y = y.to(torch.bfloat16).double()
    if bias is not None:
        y = y + bias.cpu().double()
    return y.float()


def _check_w8a8(device: torch.device, static: bool, dtype: torch.dtype) -> None:
    parts = _parts(1, static)
    linear = Linear(256, 128)
    method = Fp8LinearMethod(_on(parts, device), w8a8=True)
    linear.use_method(method)
    assert method.w8a8 and method.nbytes(linear) == 128 * 256 + 4 * 128
    for rows in (1, 3, 16, 64, 300):
        gen = torch.Generator().manual_seed(rows)
        x = (torch.randn(rows, 256, generator=gen) * 3).to(dtype)
        bias = torch.randn(128, generator=gen).to(dtype)
        y = linear.project(x.to(device), bias.to(device))
        assert y.dtype == dtype and y.shape == (rows, 128)
        expected = _w8a8_reference(x, parts, bias)
        # The fp32 sums' order, one bf16 rounding of the product and one of the bias's add.
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.float().cpu(), expected, rtol=1e-2, atol=1e-2 * scale)
    assert linear.project(torch.empty(0, 256, dtype=dtype, device=device), None).shape == (0, 128)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_w8a8_math_on_the_cpu(static: bool) -> None:
    """torch's CPU _scaled_mm with rowwise scales: the same call the CUDA path makes."""
    _check_w8a8(torch.device("cpu"), static, torch.bfloat16)


@cuda_only("FP8 tensor cores (torch._scaled_mm on cuBLAS)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_w8a8_on_an_fp8_gpu(static: bool, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    if not fp8_w8a8_supported(device):
        pytest.skip("compute capability below 8.9: no FP8 tensor cores")
    _check_w8a8(device, static, dtype)


@cuda_only("the loader's choice of method on CUDA")
def test_fp8_method_on_cuda() -> None:
    from gpu_worker.loader.quant_methods import fp8_method

    device = torch.device("cuda")
    method = fp8_method(_parts(2), device)
    assert isinstance(method, Fp8LinearMethod)
    assert method.w8a8 == fp8_w8a8_supported(device)
    assert not fp8_method(_parts(2), device, w8a8=False).w8a8  # type: ignore[union-attr]


def test_support_and_shapes_scaled_mm_cannot_take() -> None:
    assert not fp8_w8a8_supported(torch.device("cpu"))
    odd = [quantize_fp8(torch.randn(24, 40))]  # 40 inputs: not a multiple of 16
    method = Fp8LinearMethod(odd, w8a8=True)
    assert not method.w8a8  # weight-only
    x = torch.randn(2, 40)
    torch.testing.assert_close(method.apply(Linear(40, 24), x, None), x @ odd[0].dequantize().t())
    with pytest.raises(ValueError, match="one input size"):
        Fp8LinearMethod([odd[0], quantize_fp8(torch.randn(8, 32))], w8a8=False)
    with pytest.raises(ValueError, match="mixes static and dynamic"):
        Fp8LinearMethod([_parts(0, True)[0], _parts(0)[1]], w8a8=True)
