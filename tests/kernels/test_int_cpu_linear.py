"""GPTQ/AWQ-style integer weights on the CPU's GGUF kernels (gpu_worker/layers/int_cpu_linear.py,
kernels/int_to_gguf.py): the conversion is exact (the kernels' dequantization of the packed
weight equals IntWeight.dequantize() bit for bit) and takes the most compact exact type, and
apply() equals x @ dequantize().T (float64) to fp32 summation order, for 4-bit symmetric and
asymmetric, 8-bit, hand-made fp16 offsets, group sizes 32/64/128/K, with and without act-order
perms, fused parts, rows 1, 3, 16, 64 and 300 (the few-rows and the tiled paths)."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from gpu_worker.layers import int_cpu_linear
from gpu_worker.layers.int_cpu_linear import IntCpuLinearMethod
from kernels import cpu_binding
from kernels.int_to_gguf import NoExactGGUF, int_to_gguf
from kernels.quant_linear import quant_dequantize
from kernels.quant_weights import IntWeight, quantize_int

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

ROWS = [1, 3, 16, 64, 300]


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def symmetric(weight: torch.Tensor, bits: int, group_size: int) -> IntWeight:
    """GPTQ's symmetric form: zero point 2**(bits-1), fp16 scales."""
    n, k = weight.shape
    half = 1 << (bits - 1)
    w = weight.view(n, k // group_size, group_size)
    scales = _fp16(w.abs().amax(-1) / (half - 1)).clamp(min=1e-4)
    codes = (w / scales.unsqueeze(-1)).round().clamp(-half, half - 1) + half
    return IntWeight(codes.to(torch.uint8).view(n, k), scales, -half * scales, bits, group_size)


def awq_like(n: int, k: int, group_size: int, seed: int) -> IntWeight:
    """Random 4-bit codes and zero points (0-15), random fp16 scales: AWQ's form."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = _fp16(torch.rand(n, k // group_size, generator=g) * 0.02 + 1e-3)
    zeros = torch.randint(0, 16, scales.shape, generator=g).float()
    return IntWeight(codes, scales, -scales * zeros, 4, group_size)


def fp16_offsets(n: int, k: int, group_size: int, seed: int) -> IntWeight:
    """Random 4-bit codes with fp16 scales and fp16 offsets that are no integer zero points."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = _fp16(torch.rand(n, k // group_size, generator=g) * 0.02 + 1e-3)
    offsets = _fp16(torch.randn(n, k // group_size, generator=g) * 0.1)
    return IntWeight(codes, scales, offsets, 4, group_size)


def eight_bit_near_128(n: int, k: int, group_size: int, seed: int) -> IntWeight:
    """8-bit codes with zero points 120-136 and codes within 100 of them: code - zero is int8."""
    g = torch.Generator().manual_seed(seed)
    scales = _fp16(torch.rand(n, k // group_size, generator=g) * 0.01 + 1e-3)
    zeros = torch.randint(120, 137, scales.shape, generator=g).float()
    diff = torch.randint(-100, 101, (n, k), generator=g)
    codes = diff + zeros.repeat_interleave(group_size, dim=1).long()
    return IntWeight(codes.to(torch.uint8), scales, -scales * zeros, 8, group_size)


def make(kind: str, n: int, k: int, group_size: int, seed: int = 0) -> IntWeight:
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind == "sym4":
        return symmetric(dense, 4, group_size)
    if kind == "asym4":
        return quantize_int(dense, 4, group_size)
    if kind == "awq4":
        return awq_like(n, k, group_size, seed)
    if kind == "fp16_offsets":
        return fp16_offsets(n, k, group_size, seed)
    if kind == "sym8":
        return symmetric(dense, 8, group_size)
    assert kind == "near8"
    return eight_bit_near_128(n, k, group_size, seed)


# Each kind's most compact exact type.
EXPECTED = {
    "sym4": GGMLType.Q4_0,
    "fp16_offsets": GGMLType.Q4_1,
    "asym4": GGMLType.Q5_0,
    "awq4": GGMLType.Q5_0,
    "sym8": GGMLType.Q8_0,
    "near8": GGMLType.Q8_0,
}


def with_perm(part: IntWeight, seed: int) -> IntWeight:
    perm = torch.randperm(part.in_features, generator=torch.Generator().manual_seed(seed))
    return part._replace(perm=perm)


def _assert_matmul(method: IntCpuLinearMethod, weight: torch.Tensor, rows: int, seed: int) -> None:
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    expected = (x.double() @ weight.double().t()).float()
    actual = method.apply(None, x, None)  # type: ignore[arg-type]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("group_size", [32, 64, 128, 384])
def test_conversion_is_exact_and_most_compact(kind: str, group_size: int) -> None:
    part = make(kind, 70, 384, group_size)  # 70 rows: a partial last 32-column block
    packed = int_to_gguf(part.codes, part.scales, part.offsets, part.group_size)
    assert packed.qtype == EXPECTED[kind]
    assert torch.equal(quant_dequantize(packed), part.dequantize())
    permuted = with_perm(part, 1)
    assert torch.equal(IntCpuLinearMethod([permuted]).dequantize(), permuted.dequantize())


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("perm", [False, True])
def test_apply_equals_dequantized_matmul(kind: str, group_size: int, perm: bool) -> None:
    part = make(kind, 96, 256, group_size, seed=group_size)
    if perm:
        part = with_perm(part, group_size)
    method = IntCpuLinearMethod([part])
    weight = part.dequantize()
    for rows in ROWS:
        _assert_matmul(method, weight, rows, seed=rows)
    assert (method.cpu_kernel_weight() is None) == perm


@pytest.mark.parametrize("rows", ROWS)
def test_fused_parts_with_shared_and_own_perms(rows: int) -> None:
    """q, k, v of one act-order layer share a perm (gathered once); a part of another type, one
    with its own perm and one without follow; N not a multiple of 32; a bias."""
    k = 256
    shared = torch.randperm(k, generator=torch.Generator().manual_seed(7))
    parts = [
        make("sym4", 64, k, 128, seed=1)._replace(perm=shared),
        make("sym4", 32, k, 128, seed=2)._replace(perm=shared.clone()),
        make("asym4", 40, k, 64, seed=3)._replace(perm=shared),
        with_perm(make("sym8", 48, k, 32, seed=4), 9),
        make("awq4", 37, k, 256, seed=5),
    ]
    method = IntCpuLinearMethod(parts)
    assert len(method.perms) == 2
    weight = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(method.dequantize(), weight)
    bias = torch.randn(weight.shape[0])
    x = torch.randn(rows, k)
    expected = (x.double() @ weight.double().t() + bias.double()).float()
    out = torch.full((rows, weight.shape[0]), float("nan"))
    actual = method.apply(None, x, bias, out)  # type: ignore[arg-type]
    assert actual.data_ptr() == out.data_ptr()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_fused_parts_of_one_type_are_one_kernel_weight() -> None:
    """gate and up, both symmetric 4-bit without perm, become one Q4_0 weight the fused decode
    kernel can read; 3-D activations keep their leading shape."""
    parts = [make("sym4", 64, 128, 32, seed=s) for s in (1, 2)]
    method = IntCpuLinearMethod(parts)
    held = method.cpu_kernel_weight()
    assert held is not None and held[0] == int(GGMLType.Q4_0)
    assert method.nbytes(None) == 128 * 128 // 32 * 18  # type: ignore[arg-type]
    x = torch.randn(2, 3, 128)
    weight = torch.cat([p.dequantize() for p in parts])
    expected = (x.double() @ weight.double().t()).float()
    actual = method.apply(None, x, None)  # type: ignore[arg-type]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_greedy_argmax_of_one_packed_weight() -> None:
    part = make("sym4", 96, 128, 32)
    method = IntCpuLinearMethod([part])
    x = torch.randn(1, 128)
    assert torch.equal(method.greedy_argmax(x, 90), (x @ part.dequantize()[:90].t()).argmax(-1))
    assert IntCpuLinearMethod([with_perm(part, 1)]).greedy_argmax(x, 90) is None


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        (quantize_int(torch.randn(64, 128), 8, 32), "beyond int8"),
        (make("sym4", 64, 128, 32)._replace(offsets=torch.full((64, 4), 1 / 3)), "fp16"),
        (make("sym4", 64, 128, 128)._replace(scales=torch.full((64, 1), 1 / 3)), "scales"),
        (make("sym4", 64, 96, 48), "group size 48"),
    ],
)
def test_no_exact_type_runs_dense_and_says_why(
    part: IntWeight, reason: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asymmetric 8-bit codes (code - zero beyond int8), offsets or scales not exact in fp16,
    groups that are not whole 32-blocks: refused by the conversion with the reason, run as the
    exact dense W by the method, with a warning."""
    with pytest.raises(NoExactGGUF, match=reason):
        int_to_gguf(part.codes, part.scales, part.offsets, part.group_size)
    monkeypatch.setattr(int_cpu_linear, "_warned", set())  # each reason is logged once
    with caplog.at_level(logging.WARNING, logger="gpu_worker.layers.int_cpu_linear"):
        method = IntCpuLinearMethod([with_perm(part, 3)])
    assert "runs dequantized in fp32" in caplog.text and reason in caplog.text
    assert method.cpu_kernel_weight() is None
    assert method.nbytes(None) == part.codes.numel() * 4  # type: ignore[arg-type]
    permuted = with_perm(part, 3)
    for rows in (1, 64):
        _assert_matmul(method, permuted.dequantize(), rows, seed=rows)


def test_strided_codes_and_scales_as_a_loader_unpacks_them() -> None:
    """GPTQ's codes come out of their packed [K / 8, N] words transposed: not contiguous."""
    part = make("awq4", 64, 128, 32)
    strided = part._replace(
        codes=part.codes.t().contiguous().t(), scales=part.scales.t().contiguous().t()
    )
    assert not strided.codes.is_contiguous()
    method = IntCpuLinearMethod([strided])
    assert torch.equal(method.dequantize(), part.dequantize())
    _assert_matmul(method, part.dequantize(), 3, seed=0)


def test_parts_need_one_input_size() -> None:
    with pytest.raises(ValueError, match="one input size"):
        IntCpuLinearMethod([make("sym4", 32, 128, 32), make("sym4", 32, 256, 32)])
