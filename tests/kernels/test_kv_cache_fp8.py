"""The fp8 KV cache (--kv-cache-dtype fp8) in every attention path: the KV write stores
x / scale rounded to float8_e4m3fn (nearest even, saturated at +-448) byte for byte as torch's
conversion, and each backend's step (write, then attention) equals attention over K/V rounded
through fp8, the reference being x.div(scale).to(float8_e4m3fn).float().mul(scale): the C kernel
and the C and torch backends on the CPU, the Triton one-pass and split-decode kernels (CUDA, or
the interpreter with small grids), with scales other than 1 (a kernel that ignored either
scale would be far off) and with a window, sinks and a soft cap alongside."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.cpu_backend import CpuAttentionBackend
from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels import cpu_binding
from kernels.paged_attention import paged_attention_ref
from kernels.write_kv import quantize_kv, write_kv_cpu, write_kv_ref
from tests.kernels.paged_inputs import assert_close_to_reference, make_batch
from tests.worker.paged_batches import random_batch

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
needs_c = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")
# (k_scale, v_scale): the default, and scales a checkpoint might carry.
SCALES = [(1.0, 1.0), (0.05, 0.3)]
# (cached context, new queries): decodes, a fresh prompt, chunks after a context.
MIXED = [(40, 1), (0, 23), (3, 1), (21, 9), (55, 6)]


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache gives it back (the reference): x / scale through float8_e4m3fn, times
    scale, in fp32."""
    return x.float().div(scale).to(FP8).float().mul(scale)


def special_values() -> torch.Tensor:
    """Values that test the rounding's corners: ties, subnormals, the largest finite, beyond it
    (saturated), zeros of both signs, infinities and NaN, among random ones of every size."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor(
        [0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 1e9, float("inf"), -float("inf"), float("nan")]
        + [2**-10, 2**-10 * 1.0000001, 3 * 2**-11, 2**-6 * (1 - 2**-5), 100.0, 0.06640625]
        + [1.0 + 2**-4, 1.0 + 3 * 2**-4, -(2**-9), 2**-9 * 2.5, 2**-9 * 3.5, 2**-12]
    )
    scales = torch.tensor([300.0, 10.0, 1.0, 0.01, 1e-3])
    spread = (torch.randn(len(scales), 1024, generator=gen) * scales[:, None]).flatten()
    values = torch.cat([edges, spread])
    return torch.cat([values, torch.zeros(-len(values) % 128)])


def test_quantize_kv_is_the_reference_conversion_saturated():
    x = special_values()
    for scale in (1.0, 0.37):
        got = quantize_kv(x, scale).view(torch.uint8)
        expected = x.div(scale).to(FP8).view(torch.uint8)
        finite = x.abs() / scale < 448
        assert torch.equal(got[finite], expected[finite])
        # Beyond the largest finite value (and infinities): +-448, NaN stays NaN.
        big = ~finite & ~x.isnan()
        assert (quantize_kv(x, scale).float()[big].abs() == 448).all()
        assert quantize_kv(x, scale).float()[x.isnan()].isnan().all()


def _c_layout(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A torch-layout cache [2, N, bs, Hkv, D] as the C backend's keys [N, Hkv, D, bs] and values
    [N, Hkv, bs, D] (contiguous copies, any dtype)."""
    bytes_ = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    keys = bytes_[0].permute(0, 2, 3, 1).contiguous()
    values = bytes_[1].permute(0, 2, 1, 3).contiguous()
    if cache.dtype == FP8:
        return keys.view(FP8), values.view(FP8)
    return keys, values


@needs_c
@pytest.mark.parametrize("scale", [1.0, 0.37, 0.004])
def test_c_write_stores_torchs_bytes(scale):
    x = special_values()
    tokens = x.numel() // 128
    k = x.view(tokens, 2, 64)
    v = -k.flip(0)
    blocks = -(-tokens // 16) + 1
    key_cache = torch.zeros(blocks, 2, 64, 16, dtype=FP8)
    value_cache = torch.zeros(blocks, 2, 16, 64, dtype=FP8)
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[3] = -1  # skipped
    write_kv_cpu(k, v, key_cache, value_cache, slots, scale, 2 * scale)

    keys = key_cache.view(torch.uint8).permute(0, 3, 1, 2).reshape(-1, 2, 64)
    values = value_cache.view(torch.uint8).permute(0, 2, 1, 3).reshape(-1, 2, 64)
    written = slots >= 0
    assert torch.equal(keys[slots[written]], quantize_kv(k[written], scale).view(torch.uint8))
    assert torch.equal(values[slots[written]], quantize_kv(v[written], 2 * scale).view(torch.uint8))
    untouched = torch.ones(blocks * 16, dtype=torch.bool)
    untouched[slots[written]] = False
    assert (keys[untouched] == 0).all() and (values[untouched] == 0).all()


def test_triton_write_stores_torchs_bytes(device):
    from kernels.triton.write_kv import write_kv

    x = special_values()
    tokens = x.numel() // 128
    k = x.view(tokens, 2, 64).to(device)
    v = -k.flip(0)
    blocks = -(-tokens // 16) + 1
    key_cache = torch.zeros(blocks, 16, 2, 64, dtype=FP8, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[3] = -1
    for scale in (1.0, 0.37):
        write_kv(k, v, key_cache, value_cache, slots.to(device), scale, 2 * scale)
        expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
        write_kv_ref(k, v, expected_k, expected_v, slots.to(device), scale, 2 * scale)
        assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8))
        assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8))


def test_write_kv_ref_stores_the_reference_conversion():
    k = torch.randn(5, 2, 16) * 3
    v = torch.randn(5, 2, 16)
    key_cache = torch.zeros(2, 4, 2, 16, dtype=FP8)
    value_cache = torch.zeros_like(key_cache)
    write_kv_ref(k, v, key_cache, value_cache, torch.tensor([0, 7, -1, 2, 5]), 0.5, 0.25)
    assert torch.equal(key_cache.view(-1, 2, 16)[7].float(), k[1].div(0.5).to(FP8).float())
    assert torch.equal(value_cache.view(-1, 2, 16)[5].float(), v[4].div(0.25).to(FP8).float())
    assert (key_cache.view(-1, 2, 16)[[1, 3, 4, 6]].float() == 0).all()


def _fp8_step_reference(step, q, k, v, cache, k_scale, v_scale, **features):
    """The fp8 cache holding cache's context ([2, N, bs, Hkv, D] float8), and what a step over it
    must give: attention over the context and the step's k/v rounded through fp8."""
    cache8 = torch.stack([quantize_kv(cache[0], k_scale), quantize_kv(cache[1], v_scale)])
    ref = torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale])
    slots = torch.from_numpy(step.slot_mapping)
    write_kv_ref(rounded(k, k_scale), rounded(v, v_scale), ref[0], ref[1], slots)
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    expected = paged_attention_ref(q, ref[0], ref[1], *tables, q.shape[-1] ** -0.5, **features)
    written = cache8.clone()
    write_kv_ref(k, v, written[0], written[1], slots, k_scale, v_scale)
    return cache8, expected, written


@pytest.mark.parametrize(
    "backend_cls",
    [
        pytest.param(TorchAttentionBackend, id="torch"),
        pytest.param(CpuAttentionBackend, id="c", marks=needs_c),
    ],
)
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("features", ["plain", "window-sinks-cap"])
def test_cpu_backends_step_equals_attention_over_rounded_kv(
    backend_cls, k_scale, v_scale, features
):
    step, q, k, v, cache = random_batch(MIXED, 16, 2, 3, 64, seed=5)
    k, cache = k * 4, cache * 4  # keys past 1 exercise more exponents
    extra: dict[str, object] = {}
    if features != "plain":
        gen = torch.Generator().manual_seed(9)
        extra = dict(sliding_window=17, sinks=torch.randn(6, generator=gen), logits_soft_cap=5.0)
    cache8, expected, written = _fp8_step_reference(step, q, k, v, cache, k_scale, v_scale, **extra)
    if backend_cls is CpuAttentionBackend:
        n, bs, hkv, d = cache.shape[1:]
        kv_cache = torch.empty(CpuAttentionBackend.kv_cache_shape(n, bs, hkv, d), dtype=FP8)
        keys, values = CpuAttentionBackend.split_cache(kv_cache)
        c_keys, c_values = _c_layout(cache8)
        keys.view(torch.uint8).copy_(c_keys.view(torch.uint8))
        values.view(torch.uint8).copy_(c_values.view(torch.uint8))
    else:
        kv_cache = cache8.clone()
    backend = backend_cls()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    actual = backend.forward(
        q, k, v, kv_cache, meta, q.shape[-1] ** -0.5, k_scale=k_scale, v_scale=v_scale, **extra
    )
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)
    # The cache now holds the step's keys and values, quantized as the reference writes them.
    if backend_cls is CpuAttentionBackend:
        pairs = zip(CpuAttentionBackend.split_cache(kv_cache), _c_layout(written), strict=True)
    else:
        pairs = zip(kv_cache, written, strict=True)
    for got, want in pairs:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_c
def test_cpu_kernel_reads_an_fp8_cache_as_its_values_times_the_scales():
    """paged_attention_cpu alone over an fp8 cache, longer contexts (several chunks a tile, so
    both conversion buffers), GQA 8, head_dim 128, against paged_attention_ref over the
    dequantized cache; an fp8 cache whose scales were dropped differs."""
    from kernels.paged_attention import paged_attention_cpu

    batch = make_batch([(300, 1), (130, 40), (0, 7)], 2, 8, 128, 32, torch.float32, device=CPU)
    k_scale, v_scale = 0.02, 0.2
    cache8 = torch.stack(
        [quantize_kv(batch["key_cache"], k_scale), quantize_kv(batch["value_cache"], v_scale)]
    )
    tables = (batch["block_table"], batch["query_start_loc"], batch["seq_lens"])
    scale = 128**-0.5
    expected = paged_attention_ref(
        batch["query"], cache8[0].float() * k_scale, cache8[1].float() * v_scale, *tables, scale
    )
    keys, values = _c_layout(cache8)
    actual = paged_attention_cpu(
        batch["query"], keys, values, *tables, scale, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)
    unscaled = paged_attention_cpu(batch["query"], keys, values, *tables, scale)
    assert (unscaled - expected).abs().max() > 0.1


# The Triton kernels (imported in the tests only: their module needs Triton).


def _triton_step(requests, dtype, k_scale, v_scale, device, **features):
    """One Triton backend step (write_kv, then the kernel the backend picks) over an fp8 cache
    against the reference; returns nothing, asserts both the output and the cache."""
    from gpu_worker.attention.triton_backend import TritonAttentionBackend
    from tests.kernels.test_triton_backend_decode import decode_step

    batch = make_batch(requests, 2, 2, 64, 16, torch.float32, seed=3, device=device)
    k, v, cache, meta = decode_step(batch, device)
    k, v = k.to(dtype), v.to(dtype)  # what the model hands the backend
    cache8 = torch.stack([quantize_kv(cache[0], k_scale), quantize_kv(cache[1], v_scale)])
    ref = torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale])
    write_kv_ref(rounded(k, k_scale), rounded(v, v_scale), ref[0], ref[1], meta.slot_mapping)
    query = batch["query"].to(dtype)
    scale = 64**-0.5
    tables = (meta.block_table, meta.query_start_loc, meta.seq_lens)
    expected = paged_attention_ref(
        query.float(), ref[0], ref[1], *tables, scale, out_dtype=torch.float32, **features
    )
    written = cache8.clone()
    write_kv_ref(k, v, written[0], written[1], meta.slot_mapping, k_scale, v_scale)

    kv_cache = cache8.clone()
    out = TritonAttentionBackend().forward(
        query, k, v, kv_cache, meta, scale, k_scale=k_scale, v_scale=v_scale, **features
    )
    assert torch.equal(kv_cache.view(torch.uint8), written.view(torch.uint8))
    assert_close_to_reference(out, expected, dtype)


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_triton_one_pass_step_equals_attention_over_rounded_kv(k_scale, v_scale, device):
    _triton_step([(40, 1), (0, 17), (21, 9)], torch.float32, k_scale, v_scale, device)


def test_triton_one_pass_fp8_with_window_sinks_and_cap(device):
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9)).to(device)
    features = dict(sliding_window=13, sinks=sinks, logits_soft_cap=5.0)
    _triton_step([(40, 1), (21, 9)], torch.float32, 0.05, 0.3, device, **features)


def test_triton_one_pass_fp8_under_bf16(device):
    _triton_step([(40, 1), (21, 9)], torch.bfloat16, 0.05, 0.3, device)


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_triton_split_decode_step_equals_attention_over_rounded_kv(
    k_scale, v_scale, device, monkeypatch
):
    from gpu_worker.attention import triton_backend
    from kernels.triton.paged_decode import SPLIT_MIN_SEQ_LEN

    calls = []
    split = triton_backend.paged_decode_split
    monkeypatch.setattr(
        triton_backend,
        "paged_decode_split",
        lambda *a, **kw: calls.append(1) or split(*a, **kw),
    )
    _triton_step([(SPLIT_MIN_SEQ_LEN + 99, 1), (700, 1)], torch.float32, k_scale, v_scale, device)
    assert calls, "the step must take the split-context kernels"


def _every_code_as_values(layout: str, device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One request of one token whose value vectors hold every finite e4m3 code (the two NaN
    codes as 0) over 2 KV heads x 128 lanes: attention over a single key returns its value, so
    the output is each code's value times v_scale, exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    values = codes.view(2, 128).view(FP8)
    keys = quantize_kv(torch.randn(2, 128, generator=torch.Generator().manual_seed(4)), 1.0)
    if layout == "c":
        key_cache = torch.zeros(1, 2, 128, 16, dtype=FP8)
        value_cache = torch.zeros(1, 2, 16, 128, dtype=FP8)
        key_cache.view(torch.uint8)[0, :, :, 0] = keys.view(torch.uint8)
        value_cache.view(torch.uint8)[0, :, 0] = values.view(torch.uint8)
    else:
        key_cache = torch.zeros(1, 16, 2, 128, dtype=FP8)
        value_cache = torch.zeros_like(key_cache)
        key_cache.view(torch.uint8)[0, 0] = keys.view(torch.uint8)
        value_cache.view(torch.uint8)[0, 0] = values.view(torch.uint8)
    batch = {
        "query": torch.randn(1, 6, 128, generator=torch.Generator().manual_seed(5)),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": torch.zeros(1, 1, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1], dtype=torch.int32),
        "seq_lens": torch.tensor([1], dtype=torch.int32),
    }
    expected = values.float().repeat_interleave(3, dim=0)[None] * 0.3  # [1, Hq, D]
    return {k: t.to(device) for k, t in batch.items()}, expected


@needs_c
def test_c_kernel_reads_every_e4m3_code_exactly():
    from kernels.paged_attention import paged_attention_cpu

    batch, expected = _every_code_as_values("c", CPU)
    out = paged_attention_cpu(**dict(batch, q=batch.pop("query")), scale=0.1, v_scale=0.3)
    assert torch.equal(out, expected)


def test_triton_kernels_read_every_e4m3_code_exactly(device):
    from kernels.triton.paged_attention import paged_attention
    from kernels.triton.paged_decode import paged_decode_split

    batch, expected = _every_code_as_values("triton", device)
    assert torch.equal(paged_attention(**batch, scale=0.1, v_scale=0.3).cpu(), expected)
    out = paged_decode_split(**batch, scale=0.1, max_seq_len=1, v_scale=0.3)
    assert torch.equal(out.cpu(), expected)
