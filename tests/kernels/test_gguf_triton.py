"""The Triton GGUF kernels (kernels/triton/gguf_matmul.py on kernels/gguf_device.py's planes)
against gguf's dequantize, bit for bit, and against dequantize-then-matmul in float64 for the
matmul: every type they run, an odd number of output rows (a partial last block of them), K past one
tile, the one-row and the few-rows kernels, the dequantize-then-cuBLAS path for many rows, bias,
outputs written into a wider tensor, and 16-bit activations.

On the CPU they run under Triton's interpreter (tests/conftest.py); shapes stay small."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from kernels.gguf_device import DeviceQuantWeight, concat, pack_device
from kernels.triton import gguf_matmul
from tests.kernels.test_quant_linear import TYPES, quantized


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    # Summation order only: relative to the outputs' scale.
    actual = actual.float().cpu()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.cpu().double() @ weight.double().t()
    return (y if bias is None else y + bias.cpu().double()).float()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_and_row_lookup_are_ggufs(qtype: GGMLType, device: torch.device) -> None:
    n, k = 21, 512
    raw, expected = quantized(qtype, n, k, seed=3)
    w = pack_device(qtype, raw, n, k, device)
    assert torch.equal(gguf_matmul.dequantize(w).cpu(), expected)
    ids = torch.tensor([[n - 1, 0], [7, 5]], device=device)
    assert torch.equal(gguf_matmul.dequantize(w, ids).cpu(), expected[ids.cpu()])
    strided = torch.tensor([3, 99, 8, 99, 1], device=device)[::2]  # ids 2 apart in memory
    assert torch.equal(gguf_matmul.dequantize(w, strided).cpu(), expected[[3, 8, 1]])
    # Outside the table: a zero row, not a read past the planes.
    outside = gguf_matmul.dequantize(w, torch.tensor([n, -1, 2], device=device)).cpu()
    assert not outside[:2].any() and torch.equal(outside[2], expected[2])
    bf16 = gguf_matmul.dequantize(w, dtype=torch.bfloat16).cpu()
    if device.type == "cuda":
        assert torch.equal(bf16, expected.to(torch.bfloat16))
    else:  # the interpreter truncates to bf16 where the device rounds: within one ulp
        torch.testing.assert_close(bf16.float(), expected, rtol=2.0**-7, atol=0.0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_matches_dequantize_then_matmul(qtype: GGMLType, rows: int, device: torch.device) -> None:
    n, k = 37, 512
    raw, weight = quantized(qtype, n, k, seed=rows)
    w = pack_device(qtype, raw, n, k, device)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    x, bias = x.to(device), bias.to(device)
    _assert_close(gguf_matmul.matmul(x, w, bias), _reference(x, weight, bias))
    _assert_close(gguf_matmul.matmul(x, w), _reference(x, weight, None))


# One row; blocks of 16, 32 and 64 rows (two of them); the dequantize-then-cuBLAS path.
@pytest.mark.parametrize("rows", [1, 5, 20, 100, gguf_matmul.FUSED_MAX_ROWS + 3])
def test_16_bit_activations_use_the_16_bit_dequantized_weights(
    rows: int, device: torch.device
) -> None:
    """In bf16 the weights are the dequantized model's cast to bf16; sums are fp32."""
    n, k = 40, 256
    raw, weight = quantized(GGMLType.Q4_K, n, k, seed=rows)
    w = pack_device(GGMLType.Q4_K, raw, n, k, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = gguf_matmul.matmul(x.to(device), w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    expected = _reference(x.float(), weight.to(torch.bfloat16).float(), None)
    _assert_close(y, expected, rtol=1e-2)  # one bf16 rounding of the result


def test_many_rows_strided_inputs_and_outputs(device: torch.device) -> None:
    n, k = 40, 512
    raw, weight = quantized(GGMLType.Q6_K, n, k)
    w = pack_device(GGMLType.Q6_K, raw, n, k, device)
    for rows in (2, gguf_matmul.FUSED_MAX_ROWS + 1):
        wide = torch.randn(rows, k + 10, generator=torch.Generator().manual_seed(rows)).to(device)
        x = wide[:, 3 : 3 + k]  # rows k + 10 apart
        out = torch.zeros(rows, 100, device=device)
        bias = torch.randn(n).to(device)
        gguf_matmul.matmul(x, w, bias, out=out[:, 50:90])
        _assert_close(out[:, 50:90], _reference(x, weight, bias))
        assert not out[:, :50].any() and not out[:, 90:].any()
    assert gguf_matmul.matmul(torch.empty(0, k, device=device), w).shape == (0, n)


def test_concatenated_parts_are_one_weight(device: torch.device) -> None:
    """A fused projection's parts (q, k, v rows) concatenate into one weight of their rows."""
    k = 256
    parts = [quantized(GGMLType.Q4_0, n, k, seed=n) for n in (24, 8, 8)]
    packed = [pack_device(GGMLType.Q4_0, raw, raw.shape[0], k, device) for raw, _ in parts]
    w = concat(packed)
    expected = torch.cat([weight for _, weight in parts])
    assert w.out_features == 40 and torch.equal(gguf_matmul.dequantize(w).cpu(), expected)
    with pytest.raises(ValueError, match="one type"):
        raw, _ = quantized(GGMLType.Q8_0, 8, k)
        concat([w, pack_device(GGMLType.Q8_0, raw, 8, k, device)])


def test_refuses_what_it_would_misread(device: torch.device) -> None:
    raw, _ = quantized(GGMLType.Q4_1, 64, 64)
    with pytest.raises(ValueError, match="whole blocks"):
        pack_device(GGMLType.Q4_1, raw[:, :-1], 64, 64, device)
    with pytest.raises(ValueError, match="no Triton kernel"):
        pack_device(GGMLType.Q2_K, np.zeros((64, 84), np.uint8), 64, 256, device)
    w = pack_device(GGMLType.Q4_1, raw, 64, 64, device)
    with pytest.raises(ValueError, match="columns"):
        gguf_matmul.matmul(torch.randn(2, 65, device=device), w)
    with pytest.raises(ValueError, match="packed columns"):
        gguf_matmul.matmul(torch.randn(2, 64, device=device), w, out=torch.empty(64, 2).t())
    with pytest.raises(ValueError, match="must be x's"):
        gguf_matmul.matmul(torch.randn(2, 64, device=device), w, torch.randn(64).double())
    assert isinstance(w, DeviceQuantWeight) and w.nbytes == 64 * 64 // 32 * 20


def test_a_linear_and_an_embedding_on_device_planes(device: torch.device) -> None:
    """The layers the loader fills on CUDA: a projection of mixed-type parts (Q4_K q and k
    rows, Q6_K v rows, as Q4_K_M files hold them) and a quantized embedding table."""
    from gpu_worker.layers.linear import Embedding, Linear
    from gpu_worker.layers.quant_linear import GGUFLinearMethod, GGUFTritonLinearMethod

    k = 256
    (qk, qk_w), (v, v_w) = quantized(GGMLType.Q4_K, 64, k, 1), quantized(GGMLType.Q6_K, 32, k, 2)
    linear = Linear(k, 96)
    linear.use_method(
        GGUFTritonLinearMethod(
            [
                pack_device(GGMLType.Q4_K, qk[:40], 40, k, device),
                pack_device(GGMLType.Q4_K, qk[40:], 24, k, device),
                pack_device(GGMLType.Q6_K, v, 32, k, device),
            ]
        )
    )
    assert linear.weight is None and isinstance(linear.method, GGUFLinearMethod)
    assert [(p.qtype, p.out_features) for p in linear.method.parts] == [
        (GGMLType.Q4_K, 64),
        (GGMLType.Q6_K, 32),
    ]
    weight = torch.cat([qk_w, v_w])
    assert torch.equal(linear.method.dequantize().cpu(), weight)
    x, bias = torch.randn(2, 3, k), torch.randn(96)
    _assert_close(linear.project(x.to(device), bias.to(device)), _reference(x, weight, bias))
    with pytest.raises(ValueError, match="does not fit"):
        Linear(k, 95).use_method(
            GGUFTritonLinearMethod([pack_device(GGMLType.Q6_K, v, 32, k, device)])
        )
    table = Embedding(64, k)
    table.use_method(GGUFTritonLinearMethod([pack_device(GGMLType.Q4_K, qk, 64, k, device)]))
    ids = torch.tensor([[63, 0, 5]])
    assert torch.equal(table(ids.to(device)).cpu(), qk_w[ids])
