"""The quantized CPU kernels (kernels/cpu/quant_linear.c) against gguf's dequantize (and row
lookups in it) followed by a float64 matmul, for every type they run: odd column counts (a
partial last block), K past 256 rows, the few-rows and the tiled paths, bias, outputs written
into a wider tensor, and builds for other vector widths."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from kernels import cpu_binding, cpu_library, quant_linear
from kernels.gguf_quant import QuantizedWeight, pack

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

TYPES = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
]
# Byte offsets of the fp16 super-block scales of the types gguf cannot quantize (random codes
# and sub-block scales, scales kept small and finite).
_K_SCALES = {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}


def quantized(qtype: GGMLType, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random [n, k] weight as GGUF bytes of qtype, and gguf's dequantization of it."""
    rng = np.random.default_rng(seed)
    if qtype in _K_SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        for at in _K_SCALES[qtype]:
            scales = rng.uniform(1e-4, 1e-3, (n, k // block)).astype(np.float16)
            raw[..., at : at + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
        raw = raw.reshape(n, -1)
    else:
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k).copy())


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return (y if bias is None else y + bias.double()).float()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Summation order only: relative to the outputs' scale.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [32, 70])
def test_dequantize_and_row_lookup_are_ggufs(qtype: GGMLType, n: int) -> None:
    k = 512
    raw, expected = quantized(qtype, n, k, seed=n)
    packed = pack(qtype, raw, n, k)
    assert torch.equal(quant_linear.quant_dequantize(packed), expected)
    ids = torch.tensor([[n - 1, 0], [33 % n, 5]])  # the partial last block's row included
    assert torch.equal(quant_linear.quant_rows(packed, ids), expected[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 40])
def test_matches_dequantize_then_matmul(qtype: GGMLType, rows: int) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 70, block * (3 if block == 256 else 25)  # 2 full blocks + 6 columns; K = 768 or 800
    raw, weight = quantized(qtype, n, k, seed=rows)
    packed = pack(qtype, raw, n, k)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    _assert_close(quant_linear.quant_linear(x, packed, bias), _reference(x, weight, bias))
    _assert_close(quant_linear.quant_linear(x, packed), _reference(x, weight, None))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K], ids=lambda t: t.name)
def test_strided_inputs_outputs_and_threads(qtype: GGMLType) -> None:
    n, k = 40, 256
    raw, weight = quantized(qtype, n, k)
    packed = pack(qtype, raw, n, k)
    wide = torch.randn(9, k + 10)
    x = wide[:, 3 : 3 + k]  # rows k + 10 apart
    out = torch.zeros(9, 100)
    quant_linear.quant_linear(x, packed, out=out[:, 50:90])
    _assert_close(out[:, 50:90], _reference(x, weight, None))
    assert not out[:, :50].any() and not out[:, 90:].any()
    x3 = torch.randn(2, 3, k)
    _assert_close(quant_linear.quant_linear(x3, packed), _reference(x3, weight, None))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = quant_linear.quant_linear(x, packed)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(single, quant_linear.quant_linear(x, packed))  # threads split columns only
    assert quant_linear.quant_linear(torch.empty(0, k), packed).shape == (0, n)


def test_refuses_what_it_would_misread() -> None:
    raw, _ = quantized(GGMLType.Q4_1, 64, 64)
    packed = pack(GGMLType.Q4_1, raw, 64, 64)
    with pytest.raises(ValueError, match="do not match the kernel's layout"):
        quant_linear.quant_linear(torch.randn(2, 64), packed._replace(data=packed.data[:-1]))
    with pytest.raises(ValueError, match="does not match the weight's 64 inputs"):
        quant_linear.quant_linear(torch.randn(2, 65), packed)
    with pytest.raises(ValueError, match="bias"):
        quant_linear.quant_linear(torch.randn(2, 64), packed, torch.randn(63))
    with pytest.raises(ValueError, match="whole blocks"):
        pack(GGMLType.Q4_1, raw[:, :-1], 64, 64)
    with pytest.raises(ValueError, match="no CPU kernel"):
        pack(GGMLType.Q2_K, raw, 64, 64)
    assert isinstance(packed, QuantizedWeight) and packed.nbytes == 2 * 2 * 640


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64"])
def test_builds_for_other_vector_widths(march: str, tmp_path: Path) -> None:
    """The kernels compile for AVX-512 (16-float vectors) and for plain x86-64 (the fallbacks of
    vec.h), not only for this machine."""
    cc = cpu_library._compiler()
    flags = [f for f in cpu_library._FLAGS if f not in ("-march=native", "-O3")]
    source = Path(cpu_library.__file__).parent / "cpu" / "quant_linear.c"
    result = subprocess.run(
        [
            cc,
            *flags,
            "-O0",
            f"-march={march}",
            "-Wno-psabi",
            "-c",
            str(source),
            "-o",
            str(tmp_path / "quant_linear.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_argmax_is_the_argmax_of_the_logits(qtype: GGMLType) -> None:
    """Greedy decode's output projection: the index quant_linear() + argmax give, over the first
    `vocab` columns (a vocabulary short of the packed rows), for every row count it takes."""
    n, k = 200, GGML_QUANT_SIZES[qtype][0] * (2 if GGML_QUANT_SIZES[qtype][0] == 256 else 12)
    raw, _ = quantized(qtype, n, k, seed=5)
    packed = pack(qtype, raw, n, k)
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, quant_linear.quant_few_rows() + 1):
        x = torch.randn(rows, k, generator=gen)
        logits = quant_linear.quant_linear(x, packed)
        for vocab in (n, 150, 7):
            expected = logits[:, :vocab].argmax(dim=1)
            assert torch.equal(quant_linear.quant_linear_argmax(x, packed, vocab), expected)


def test_fused_argmax_ties_and_refusals() -> None:
    """Equal maxima give the first index, across blocks and threads; what it cannot take is
    refused."""
    n, k = 192, 64
    raw, _ = quantized(GGMLType.Q8_0, n, k, seed=2)
    raw = raw.reshape(n, -1).copy()
    # Rows equal to row 5, so are their logits: in its block, the next block (one thread's
    # run of blocks) and the last (another thread's, with 2 or more).
    for row in (20, 40, 150):
        raw[row] = raw[5]
    packed = pack(GGMLType.Q8_0, raw, n, k)
    logits = quant_linear.quant_dequantize(packed)[5]
    x = logits.unsqueeze(0).clone()  # x = row 5's weights: its logit is the largest
    assert int(quant_linear.quant_linear_argmax(x, packed, n)) == 5
    assert int(quant_linear.quant_linear(x, packed).argmax()) == 5
    with pytest.raises(ValueError, match="the fused argmax takes 1 to"):
        quant_linear.quant_linear_argmax(
            torch.randn(quant_linear.quant_few_rows() + 1, k), packed, n
        )
    with pytest.raises(ValueError, match="do not match"):
        quant_linear.quant_linear_argmax(torch.randn(1, k), packed, n + 1)
