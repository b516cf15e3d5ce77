"""The Triton int4/int8 GEMM (kernels/triton/int_matmul.py on kernels/int_device.py's layout)
against x @ IntWeight.dequantize().T: bits 4 and 8, group sizes 32/64/128/K, act-order perms,
rows 1, 3, 16, 64 and 300 (split-K for the few-rows configurations), fp32 and bf16 activations;
IntTritonLinearMethod's parts; GGUF Q4_0/Q4_1/Q4_K/Q8_0 converted to IntWeight, equal to
gguf.quants' dequantization bit for bit.

On the CPU they run under Triton's interpreter (tests/conftest.py); shapes stay small."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from kernels.gguf_device import pack_device
from kernels.int_device import (
    GGUF_INT_TYPES,
    concat,
    dequantize_rows,
    gguf_to_int,
    pack_int,
    unpack_codes,
)
from kernels.quant_weights import IntWeight, quantize_int
from kernels.triton import int_matmul
from tests.kernels.test_quant_linear import quantized

ROWS = [1, 3, 16, 64, 300]


def _weight(n: int, k: int, bits: int, group: int, seed: int, perm: bool = False) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    w = quantize_int(torch.randn(n, k, generator=gen), bits, group)
    return w._replace(perm=torch.randperm(k, generator=gen)) if perm else w


def _on(w: IntWeight, device: torch.device) -> IntWeight:
    return w._replace(
        codes=w.codes.to(device),
        scales=w.scales.to(device),
        offsets=w.offsets.to(device),
        perm=None if w.perm is None else w.perm.to(device),
    )


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.cpu().double() @ weight.cpu().double().t()
    return (y if bias is None else y + bias.cpu().double()).float()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    # Summation order only (fp32): relative to the outputs' scale.
    actual = actual.float().cpu()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 256])  # 256: K, one group per row
def test_layout_round_trips(bits: int, group: int, device: torch.device) -> None:
    w = _weight(40, 256, bits, group, seed=bits + group, perm=group == 64)
    packed = pack_int(_on(w, device))
    assert packed.qweight.dtype == torch.int32
    assert packed.qweight.shape == (256 * bits // 32, 40) and packed.in_features == 256
    assert torch.equal(unpack_codes(packed).cpu(), w.codes.to(torch.int32))
    assert torch.equal(dequantize_rows(packed).cpu(), w.dequantize())
    rows = torch.tensor([39, 0, 7], device=device)
    assert torch.equal(dequantize_rows(packed, rows).cpu(), w.dequantize()[[39, 0, 7]])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_fp32_matches_dequantize_then_matmul(
    bits: int, group: int, rows: int, device: torch.device
) -> None:
    n, k = 72, 256  # a partial last block of columns
    w = _weight(n, k, bits, group, seed=rows, perm=group == 128)
    packed = pack_int(_on(w, device))
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    y = int_matmul.matmul(x.to(device), packed, bias.to(device))
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    _assert_close(y, _reference(x, w.dequantize(), bias))
    _assert_close(int_matmul.matmul(x.to(device), packed), _reference(x, w.dequantize(), None))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_uses_the_bf16_dequantized_weights(bits: int, rows: int, device: torch.device) -> None:
    """In bf16 the weights are the dequantized model's cast to bf16; sums are fp32."""
    n, k = 48, 512
    w = _weight(n, k, bits, 128, seed=rows)
    packed = pack_int(_on(w, device))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    y = int_matmul.matmul(x.to(device), packed, bias.to(device))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    weight = w.dequantize().to(torch.bfloat16).float()
    _assert_close(y, _reference(x.float(), weight, bias.float()), rtol=1e-2)  # bf16 result


def test_few_rows_split_k_and_many_rows_do_not(device: torch.device) -> None:
    """Few rows: BLOCK_M 16 and split-K until the grid fills the SMs (twice over); many: none.
    The configuration is a function of the shape alone."""
    sms = int_matmul._multiprocessors(device)
    for rows in (1, 16):
        cfg = int_matmul.choose_config(rows, 64, 4096, 128, device)
        assert cfg.block_m == 16 and cfg.split_k > 1
        # One column tile: split until the grid covers 2 x SMs (at most 16 splits).
        assert cfg.split_k == min(16, 1 << (2 * sms - 1).bit_length())
        assert cfg.block_k <= 128
    assert int_matmul.choose_config(300, 64, 4096, 128, device).split_k == 1
    assert int_matmul.choose_config(1, 64, 4096, 32, device).block_k == 32  # one scale row
    assert int_matmul.choose_config(5, 4096, 4096, 128, device) == int_matmul.choose_config(
        5, 4096, 4096, 128, device
    )


def test_strided_inputs_outputs_and_refusals(device: torch.device) -> None:
    n, k = 40, 128
    w = _weight(n, k, 4, 32, seed=1)
    packed = pack_int(_on(w, device))
    for rows in (2, 70):
        wide = torch.randn(rows, k + 10, generator=torch.Generator().manual_seed(rows))
        x = wide.to(device)[:, 3 : 3 + k]  # rows k + 10 apart
        out = torch.zeros(rows, 100, device=device)
        bias = torch.randn(n)
        int_matmul.matmul(x, packed, bias.to(device), out=out[:, 50:90])
        _assert_close(out[:, 50:90], _reference(x, w.dequantize(), bias))
        assert not out[:, :50].any() and not out[:, 90:].any()
    assert int_matmul.matmul(torch.empty(0, k, device=device), packed).shape == (0, n)
    with pytest.raises(ValueError, match="columns"):
        int_matmul.matmul(torch.randn(2, k + 1, device=device), packed)
    with pytest.raises(ValueError, match="packed columns"):
        int_matmul.matmul(torch.randn(2, k, device=device), packed, out=torch.empty(n, 2).t())
    with pytest.raises(ValueError, match="must be x's"):
        int_matmul.matmul(torch.randn(2, k, device=device), packed, torch.randn(n).double())
    with pytest.raises(ValueError, match="3-bit"):
        pack_int(w._replace(bits=3))
    with pytest.raises(ValueError, match="multiple"):
        pack_int(IntWeight(w.codes[:, :36], w.scales[:, :1], w.offsets[:, :1], 4, 36))


def test_a_linear_of_parts_and_an_embedding(device: torch.device) -> None:
    """Parts of one bits, group and perm are one weight (q, k, v rows); others stay apart."""
    from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod
    from gpu_worker.layers.linear import Embedding, Linear

    def on(w: IntWeight) -> IntWeight:
        return _on(w, device)

    k = 256
    q, kk, v = (_weight(n, k, 4, 128, seed=n) for n in (32, 16, 16))
    eight = _weight(16, k, 8, 64, seed=5)
    linear = Linear(k, 80, bias=True)
    linear.use_method(IntTritonLinearMethod([on(q), on(kk), on(v), on(eight)]))
    method = linear.method
    assert isinstance(method, IntTritonLinearMethod)
    assert [(p.bits, p.out_features) for p in method.parts] == [(4, 64), (8, 16)]
    weight = torch.cat([q.dequantize(), kk.dequantize(), v.dequantize(), eight.dequantize()])
    assert torch.equal(method.dequantize().cpu(), weight)
    assert method.nbytes(linear) == 64 * k // 2 + 16 * k + 2 * 4 * (64 * 2 + 16 * 4)
    x, bias = torch.randn(2, 3, k), torch.randn(80)
    y = linear.project(x.to(device), bias.to(device))
    assert y.shape == (2, 3, 80)
    _assert_close(y.reshape(6, 80), _reference(x.reshape(6, k), weight, bias))
    perm = torch.randperm(k)
    with_perm = [q._replace(perm=perm), kk._replace(perm=perm.clone()), v]
    assert len(IntTritonLinearMethod([on(p) for p in with_perm]).parts) == 2
    table = Embedding(32, k)
    table.use_method(IntTritonLinearMethod([on(q)]))
    ids = torch.tensor([[31, 0, 5]])
    looked_up = table(ids.to(device)).cpu()
    assert torch.equal(looked_up, q.dequantize()[ids].to(looked_up.dtype))
    with pytest.raises(ValueError, match="one input size"):
        IntTritonLinearMethod([on(q), on(_weight(8, 128, 4, 32, seed=0))])
    with pytest.raises(ValueError, match="join"):
        concat([pack_int(on(q)), pack_int(on(eight))])


@pytest.mark.parametrize("qtype", sorted(GGUF_INT_TYPES), ids=lambda t: t.name)
def test_gguf_types_are_int_weights_bit_for_bit(qtype: GGMLType, device: torch.device) -> None:
    n, k = 21, 512
    raw, expected = quantized(qtype, n, k, seed=3)
    w = gguf_to_int(pack_device(qtype, raw, n, k, device))
    assert w.bits == (8 if qtype == GGMLType.Q8_0 else 4) and w.group_size == 32
    assert torch.equal(w.dequantize().cpu(), expected)
    packed = pack_int(w)
    assert torch.equal(dequantize_rows(packed).cpu(), expected)
    for rows in (1, 5, 40):
        gen = torch.Generator().manual_seed(rows)
        x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
        y = int_matmul.matmul(x.to(device), packed, bias.to(device))
        _assert_close(y, _reference(x, expected, bias))


def test_other_gguf_types_are_refused(device: torch.device) -> None:
    raw, _ = quantized(GGMLType.Q6_K, 8, 256)
    with pytest.raises(ValueError, match="Q6_K"):
        gguf_to_int(pack_device(GGMLType.Q6_K, raw, 8, 256, device))


def test_a_projection_of_q4_k_and_q8_0_parts(device: torch.device) -> None:
    """What the GGUF loader builds on CUDA for a projection of Q4_K and Q8_0 parts (one with a
    Q5/Q6 part keeps the GGUF kernels; tests/worker/test_gguf_model.py runs the loader)."""
    from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod
    from gpu_worker.layers.linear import Linear

    k = 256
    (a, a_w), (b, b_w) = quantized(GGMLType.Q4_K, 32, k, 1), quantized(GGMLType.Q8_0, 16, k, 2)
    parts = [
        gguf_to_int(pack_device(GGMLType.Q4_K, a, 32, k, device)),
        gguf_to_int(pack_device(GGMLType.Q8_0, b, 16, k, device)),
    ]
    linear = Linear(k, 48)
    linear.use_method(IntTritonLinearMethod(parts))
    x = torch.randn(3, k)
    _assert_close(linear.project(x.to(device), None), _reference(x, torch.cat([a_w, b_w]), None))


@pytest.mark.parametrize("k, group", [(96, 96), (96, 32), (320, 64), (352, 352)])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_k_past_whole_tiles_and_uneven_splits(
    k: int, group: int, rows: int, device: torch.device
) -> None:
    """K not a multiple of the K tile (a masked last tile), split-K ranges of unequal tiles,
    per-channel groups of any size."""
    n = 24
    for bits in (4, 8):
        w = _weight(n, k, bits, group, seed=k + rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = int_matmul.matmul(x.to(device), pack_int(_on(w, device)))
        _assert_close(y, _reference(x, w.dequantize(), None))
