"""The fused elementwise Triton kernels (kernels/triton/rms_norm.py, kernels/triton/rotary.py,
kernels/triton/activation.py) against the torch formulas the layers run without them.

References are computed in fp32 from the same (rounded) inputs; a 16-bit result must lie within
one ulp of it (the device rounds to nearest, the interpreter truncates: both are within one ulp).
Row-strided inputs are slices of wider tensors, as the layers pass them (q and k out of the qkv
projection). eps is large and the weights random, so a kernel that ignored either would fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from kernels import activation, rms_norm, rotary
from kernels.triton import activation as triton_activation
from kernels.triton import rms_norm as triton_rms_norm
from kernels.triton import rotary as triton_rotary
from tests.kernels.paged_inputs import cuda_only

EPS = 0.1
_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """actual (in dtype) within one ulp of dtype of the fp32 reference expected; fp32 within a
    few fp32 ulps (the kernels' sums and fused multiply-adds round differently from torch's)."""
    assert actual.dtype == dtype, f"result dtype {actual.dtype} != {dtype}"
    actual, expected = actual.float().cpu(), expected.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    # ulp of dtype at |expected|; inf-free, and tiny values get the smallest normal's ulp.
    exponent = torch.floor(torch.log2(expected.abs().clamp_min(2.0**-14)))
    ulp = torch.exp2(exponent - _MANTISSA[dtype])
    err = (actual - expected).abs()
    bad = err > ulp * 1.001
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} elements off by more than one ulp, worst "
        f"{float((err / ulp).max()):.2f} ulp"
    )


def _norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward's torch formula, in fp32."""
    return F.rms_norm(x.float().cpu(), (x.shape[-1],), weight.float().cpu(), eps)


# --- rms_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,hidden,dtype,weight_dtype",
    [
        (1, 72, torch.float32, torch.float32),
        (5, 200, torch.float32, torch.float32),
        (5, 72, torch.bfloat16, torch.float32),
        (1, 200, torch.bfloat16, torch.bfloat16),
        (5, 200, torch.bfloat16, torch.bfloat16),
    ],
)
def test_rms_norm_matches_torch(tokens, hidden, dtype, weight_dtype, device):
    gen = torch.Generator().manual_seed(tokens * hidden)
    # A slice of a wider tensor: rows are not contiguous.
    wide = _rand(gen, tokens, hidden + 24, scale=0.5).to(dtype).to(device)
    x = wide[:, 8 : 8 + hidden]
    weight = (1 + _rand(gen, hidden, scale=0.5)).to(weight_dtype).to(device)
    before = wide.clone()

    out = triton_rms_norm.rms_norm(x, weight, EPS)

    assert out.shape == x.shape and out.is_contiguous()
    assert_within_ulp(out, _norm_ref(x, weight, EPS), dtype)
    torch.testing.assert_close(wide, before, rtol=0, atol=0)  # x is read only
    # The existing torch path (RMSNorm on the CPU) agrees to dtype's rounding.
    module = RMSNorm(hidden, EPS)
    module.weight.data = weight.cpu()
    torch.testing.assert_close(out.cpu(), module(x.cpu()))


def test_rms_norm_heads_view_and_out(device):
    # Per-head q norm (Qwen3): [T, heads, head_dim] sliced out of the qkv rows.
    tokens, heads, kv_heads, head_dim = 5, 3, 1, 72
    gen = torch.Generator().manual_seed(7)
    qkv = _rand(gen, tokens, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16).to(device)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    assert q.data_ptr() == qkv.data_ptr()  # a view, not a copy
    weight = _rand(gen, head_dim).to(device)
    # out: a strided view too; the columns around it stay untouched.
    buf = torch.full((tokens, heads, head_dim + 8), 7.0, dtype=torch.bfloat16, device=device)
    out = buf[..., :head_dim]

    result = triton_rms_norm.rms_norm(q, weight, EPS, out=out)

    assert result is out
    assert_within_ulp(out, _norm_ref(q, weight, EPS), torch.bfloat16)
    assert (buf[..., head_dim:] == 7.0).all()


def test_rms_norm_eps_and_weight_matter(device):
    # Guards the tests above: a kernel ignoring eps or the weight would be far off.
    gen = torch.Generator().manual_seed(3)
    x = _rand(gen, 2, 200, scale=0.5).to(device)
    weight = (1 + _rand(gen, 200, scale=0.5)).to(device)
    out = triton_rms_norm.rms_norm(x, weight, EPS).cpu()
    assert not torch.allclose(out, _norm_ref(x, weight, 1e-6), rtol=1e-2)
    assert not torch.allclose(out, _norm_ref(x, torch.ones_like(weight), EPS), rtol=1e-2)


@pytest.mark.parametrize(
    "tokens,hidden,dtype",
    [(1, 200, torch.float32), (5, 72, torch.float32), (5, 200, torch.bfloat16)],
)
def test_add_rms_norm_updates_residual_in_place(tokens, hidden, dtype, device):
    gen = torch.Generator().manual_seed(tokens + hidden)
    wide = _rand(gen, tokens, 2 * hidden, scale=0.5).to(dtype).to(device)
    x = wide[:, hidden:]  # strided rows
    res_buf = _rand(gen, tokens, hidden + 16, scale=0.5).to(dtype).to(device)
    residual = res_buf[:, :hidden]  # strided rows
    weight = (1 + _rand(gen, hidden, scale=0.5)).to(dtype).to(device)
    x_before, res_before, buf_before = x.clone(), residual.clone(), res_buf.clone()

    normed, res_out = triton_rms_norm.add_rms_norm(x, residual, weight, EPS)

    # residual now holds x + residual (in its dtype), in place; x is unchanged.
    assert res_out is residual
    exact_sum = x_before.float() + res_before.float()
    assert_within_ulp(residual, exact_sum, dtype)
    if device.type == "cuda" or dtype == torch.float32:
        # Round-to-nearest like torch's add (the interpreter truncates 16-bit stores).
        torch.testing.assert_close(residual, x_before + res_before, rtol=0, atol=0)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    torch.testing.assert_close(res_buf[:, hidden:], buf_before[:, hidden:], rtol=0, atol=0)
    # normed is the norm of the rounded sum that was stored, as in the torch path
    # (residual = x + residual; norm(residual)).
    assert normed.shape == x.shape and normed.dtype == dtype
    assert_within_ulp(normed, _norm_ref(residual, weight, EPS), dtype)
    torch_ref = _norm_ref(x_before + res_before, weight, EPS).to(dtype)
    torch.testing.assert_close(normed.cpu(), torch_ref)


def test_rms_norm_rejects_bad_inputs(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(AssertionError, match="weight shape"):
        triton_rms_norm.rms_norm(x, torch.ones(4, device=device), EPS)
    with pytest.raises(AssertionError, match="residual shape"):
        triton_rms_norm.add_rms_norm(
            x, torch.zeros(2, 4, device=device), torch.ones(8, device=device), 1
        )
    with pytest.raises(AssertionError, match="contiguous"):
        triton_rms_norm.rms_norm(x.t(), torch.ones(2, device=device), EPS)
    assert not rms_norm.flattens(x.t())
    assert rms_norm.flattens(torch.zeros(2, 3, 4, 8)[:, :, 1])


# --- rotary --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,head_dim,dtype,table_dtype",
    [
        (1, 64, torch.float32, torch.float32),
        (5, 72, torch.float32, torch.float32),
        (5, 72, torch.bfloat16, torch.bfloat16),
        (1, 64, torch.bfloat16, torch.float32),
    ],
)
def test_rotary_matches_torch(tokens, head_dim, dtype, table_dtype, device):
    heads, kv_heads = 3, 1
    gen = torch.Generator().manual_seed(tokens * head_dim)
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions, table_dtype)
    qkv = _rand(gen, tokens, (heads + 2 * kv_heads) * head_dim).to(dtype).to(device)
    # q and k as SelfAttention rotates them: one strided view of the qkv rows.
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    before = qkv.clone()
    expected = rope.apply(qk.float().cpu(), cos.float(), sin.float())

    result = triton_rotary.rotary_(qk, cos.to(device), sin.to(device))

    assert result is qk
    assert_within_ulp(qk, expected, dtype)
    width = qk.shape[1] * head_dim
    # v is untouched.
    torch.testing.assert_close(qkv[:, width:], before[:, width:], rtol=0, atol=0)
    # The existing torch path (RotaryEmbedding.apply in dtype) agrees to dtype's rounding.
    torch_path = rope.apply(before[:, :width].view_as(qk).cpu(), cos, sin)
    torch.testing.assert_close(qk.cpu(), torch_path.to(dtype), rtol=2e-2, atol=2e-2)


def test_rotary_position_matters(device):
    # Guards the test above: the tables are used per token, not one row for all.
    rope = RotaryEmbedding(64, 64, 10000.0)
    x = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(0)).to(device)
    cos, sin = rope.cos_sin(torch.tensor([3, 40]), torch.float32)
    out = triton_rotary.rotary_(x.clone(), cos.to(device), sin.to(device)).cpu()
    swapped = rope.apply(x.cpu(), cos.flip(0), sin.flip(0))
    assert not torch.allclose(out, swapped, atol=1e-3)
    assert_within_ulp(out, rope.apply(x.cpu(), cos, sin), torch.float32)


def test_rotary_rejects_bad_inputs(device):
    x = torch.zeros(2, 3, 8, device=device)
    cos = torch.zeros(2, 1, 8, device=device)
    with pytest.raises(AssertionError, match="even"):
        triton_rotary.rotary_(torch.zeros(2, 3, 7, device=device), cos[..., :7], cos[..., :7])
    with pytest.raises(AssertionError, match="cos shape"):
        triton_rotary.rotary_(x, cos[:1], cos)
    assert not rotary.fits(x.transpose(1, 2))
    assert rotary.fits(x)


# --- silu_and_mul --------------------------------------------------------------------------


def _silu_ref(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().cpu().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize(
    "tokens,inter,dtype",
    [(1, 72, torch.float32), (5, 200, torch.float32), (5, 200, torch.bfloat16)],
)
def test_silu_and_mul_matches_torch(tokens, inter, dtype, device):
    gen = torch.Generator().manual_seed(tokens * inter)
    wide = _rand(gen, tokens, 2 * inter + 24, scale=3.0).to(dtype).to(device)
    y = wide[:, : 2 * inter]  # strided rows

    out = triton_activation.silu_and_mul(y)

    assert out.shape == (tokens, inter) and out.is_contiguous()
    assert_within_ulp(out, _silu_ref(y), dtype)
    # The existing torch path (chunk, silu, mul in dtype) agrees to dtype's rounding.
    gate, up = y.cpu().chunk(2, dim=-1)
    torch.testing.assert_close(out.cpu(), F.silu(gate) * up)


def test_silu_and_mul_column_blocks_and_leading_dims(device, monkeypatch):
    # Several column blocks per row, the last one partial, over [2, T, 2I].
    monkeypatch.setattr(triton_activation, "_INTERPRETER_BLOCK", 64)
    monkeypatch.setattr(triton_activation, "_BLOCK", 64)
    gen = torch.Generator().manual_seed(11)
    y = _rand(gen, 2, 3, 400, scale=3.0).to(torch.bfloat16).to(device)

    out = triton_activation.silu_and_mul(y)

    assert out.shape == (2, 3, 200)
    assert_within_ulp(out, _silu_ref(y), torch.bfloat16)
    assert not activation.fits(y.transpose(0, 2))
    with pytest.raises(AssertionError, match="even"):
        triton_activation.silu_and_mul(y[..., :7])


# --- wiring (CUDA only: on the CPU the layers keep their C-kernel and torch paths) ----------


@cuda_only("the layers take the Triton kernels only for CUDA tensors")
def test_layers_use_kernels_on_cuda():
    from gpu_worker.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    norm = RMSNorm(200, EPS)
    norm.weight.data = 1 + _rand(gen, 200, scale=0.5)
    x, res = _rand(gen, 5, 200).to(dtype), _rand(gen, 5, 200).to(dtype)
    cpu_normed, cpu_res = norm.forward_with_residual(x, res.clone())
    norm.cuda()
    res_cuda = res.cuda()
    normed, res_out = norm.forward_with_residual(x.cuda(), res_cuda)
    assert res_out is res_cuda  # updated in place: the fused kernel ran
    torch.testing.assert_close(res_out.cpu(), cpu_res, rtol=0, atol=0)
    torch.testing.assert_close(normed.cpu(), cpu_normed)
    torch.testing.assert_close(norm(x.cuda()).cpu(), norm.cpu()(x))

    rope = RotaryEmbedding(72, 64, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(5), dtype)
    qk = _rand(gen, 5, 4, 72).to(dtype)
    expected = rope.apply_(qk.clone(), cos, sin)
    rope.cuda()
    torch.testing.assert_close(
        rope.apply_(qk.cuda(), cos.cuda(), sin.cuda()).cpu(), expected, rtol=2e-2, atol=2e-2
    )

    y = _rand(gen, 5, 400, scale=3.0).to(dtype)
    torch.testing.assert_close(silu_and_mul(y.cuda()).cpu(), silu_and_mul(y))
