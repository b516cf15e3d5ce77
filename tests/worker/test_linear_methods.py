"""The linear-method contract (gpu_worker/layers/linear_method.py): every way a Linear holds its
weight computes x @ W^T + b for the same W, and says what its kernels fuse (the argmax, the
SwiGLU activation, the fused decode stack's view) only where they do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGMLType

from gpu_worker.layers.cpu_linear import (
    BlockedLinearMethod,
    SplitLinearMethod,
    SwiGLUPairsLinearMethod,
)
from gpu_worker.layers.dense_linear import DenseLinearMethod
from gpu_worker.layers.linear import Embedding, Linear
from gpu_worker.layers.linear_method import LinearMethod
from gpu_worker.layers.quant_linear import GGUFCpuLinearMethod
from gpu_worker.loader.cpu_layout import use_cpu_linear_layout
from gpu_worker.models.blocks import GatedMLP
from gpu_worker.models.mlp_layout import ThreadSplitMLPLayout
from kernels import cpu_binding
from kernels.decode_stack import F32_BLOCKED, F32_PAIRS
from kernels.gguf_quant import pack
from tests.kernels.test_quant_linear import quantized

c_kernels = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler")
N, K = 128, 96


def _linear(weight: torch.Tensor, bias: bool = True) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias)
    assert layer.weight is not None
    layer.weight.data.copy_(weight)
    if layer.bias is not None:
        layer.bias.data.copy_(torch.linspace(-1, 1, weight.shape[0]))
    return layer


def _expected(layer_weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    return F.linear(x.double(), layer_weight.double(), None if bias is None else bias.double())


def _relaid(
    method: type[LinearMethod], weight: torch.Tensor
) -> tuple[Linear, LinearMethod, torch.Tensor]:
    """A Linear holding W by method, the method, and W as the method holds it."""
    layer = _linear(weight)
    relaid: LinearMethod = layer.method
    if method is BlockedLinearMethod:
        relaid = BlockedLinearMethod(weight)
    elif method is SplitLinearMethod:
        relaid = SplitLinearMethod(weight, 4)
    elif method is SwiGLUPairsLinearMethod:
        relaid = SwiGLUPairsLinearMethod(weight)
    elif method is GGUFCpuLinearMethod:
        raw, weight = quantized(GGMLType.Q8_0, N, K, seed=1)
        relaid = GGUFCpuLinearMethod([pack(GGMLType.Q8_0, raw, N, K)])
    if relaid is not layer.method:
        layer.use_method(relaid)
    return layer, relaid, weight


@pytest.mark.parametrize(
    "method",
    [
        DenseLinearMethod,
        pytest.param(BlockedLinearMethod, marks=c_kernels),
        SplitLinearMethod,
        pytest.param(SwiGLUPairsLinearMethod, marks=c_kernels),
        pytest.param(GGUFCpuLinearMethod, marks=c_kernels),
    ],
    ids=lambda m: m.__name__,
)
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_every_method_applies_w(method: type[LinearMethod], rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(N, K, generator=gen) * 0.1
    layer, relaid, held = _relaid(method, weight)
    assert layer.method is relaid and type(relaid) is method
    x = torch.randn(2, rows, K, generator=gen)
    assert layer.bias is not None
    want = _expected(held, x, layer.bias)
    got = layer(x)
    assert got.shape == (2, rows, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        layer.project(x, None).double(), want - layer.bias, atol=1e-4, rtol=0
    )
    assert relaid.nbytes(layer) > 0
    if method is not DenseLinearMethod:  # re-laid once only
        assert relaid.process_weights_after_loading(layer) is relaid


@c_kernels
def test_what_the_kernels_fuse() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=gen)
    x = torch.randn(3, K, generator=gen)
    logits = x @ weight.t()

    layer, blocked, _ = _relaid(BlockedLinearMethod, weight)
    assert torch.equal(blocked.greedy_argmax(x, 100), logits[:, :100].argmax(-1))
    assert blocked.cpu_kernel_weight() == (F32_BLOCKED, blocked.weight)  # type: ignore[attr-defined]

    _, pairs, _ = _relaid(SwiGLUPairsLinearMethod, weight)
    gate, up = logits.chunk(2, dim=-1)
    torch.testing.assert_close(pairs.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert pairs.cpu_kernel_weight() == (F32_PAIRS, pairs.weight)  # type: ignore[attr-defined]

    for plain in (_linear(weight).method, SplitLinearMethod(weight, 4)):
        assert plain.greedy_argmax(x, 100) is None
        assert plain.silu_and_mul(x) is None
        assert plain.cpu_kernel_weight() is None

    _, gguf, _ = _relaid(GGUFCpuLinearMethod, weight)
    assert isinstance(gguf, GGUFCpuLinearMethod)
    assert torch.equal(gguf.greedy_argmax(x[:1], N), gguf.apply(layer, x[:1], None).argmax(-1))
    qtype, data = gguf.cpu_kernel_weight() or (None, None)
    assert qtype == int(GGMLType.Q8_0) and data is gguf.parts[0].data


def test_dense_weights_are_relaid_for_the_cpu(monkeypatch) -> None:
    """After loading: the blocked layout where the C kernel runs, else the split one; a weight
    another module shares stays held, and the split layout uses it for many rows."""
    weight = torch.randn(N, K)
    layer = _linear(weight)
    use_cpu_linear_layout(layer, threads=4, keep_weight=False)
    expected = BlockedLinearMethod if cpu_binding.available() else SplitLinearMethod
    assert type(layer.method) is expected and layer.weight is None
    monkeypatch.setattr(cpu_binding, "available", lambda: False)
    tied = _linear(weight)
    use_cpu_linear_layout(tied, threads=4, keep_weight=True)
    assert isinstance(tied.method, SplitLinearMethod) and tied.weight is not None
    x = torch.randn(300, K)
    torch.testing.assert_close(tied(x), F.linear(x, weight, tied.bias), rtol=1e-5, atol=1e-5)
    odd = _linear(weight[:30])
    use_cpu_linear_layout(odd, threads=4, keep_weight=False)
    assert isinstance(odd.method, DenseLinearMethod) and odd.weight is not None  # 30 % 4


@pytest.mark.parametrize("layout", ["fused", "thread-split", "dense"])
def test_gated_mlp_layouts_agree(layout: str, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    mlp = GatedMLP(K, 64)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        assert linear.weight is not None
        linear.weight.data.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.2)
    x = torch.randn(5, K, generator=gen)
    gate_up, down = mlp.gate_up_proj.weight, mlp.down_proj.weight
    assert gate_up is not None and down is not None
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    want = (F.silu(gate) * up) @ down.t()
    if layout == "fused":
        if not cpu_binding.available():
            pytest.skip("no C compiler")
        monkeypatch.setattr("kernels.linear.fused_swiglu_pays", lambda: True)
        assert mlp.use_fused_swiglu()
        assert isinstance(mlp.gate_up_proj.method, SwiGLUPairsLinearMethod)
    elif layout == "thread-split":
        mlp.use_thread_split(4)
        assert isinstance(mlp.layout, ThreadSplitMLPLayout) and mlp.gate_up_proj.weight is None
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


def test_a_method_of_another_shape_is_refused() -> None:
    raw, _ = quantized(GGMLType.Q8_0, 32, 64)
    with pytest.raises(ValueError, match="does not fit"):
        Linear(64, 33).use_method(GGUFCpuLinearMethod([pack(GGMLType.Q8_0, raw, 32, 64)]))
    with pytest.raises(ValueError, match="does not fit"):
        Embedding(33, 64).use_method(GGUFCpuLinearMethod([pack(GGMLType.Q8_0, raw, 32, 64)]))
