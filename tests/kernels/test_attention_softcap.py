"""Attention logits soft-capping (Gemma 2's attn_logit_softcapping: each scaled score s becomes
c * tanh(s / c) before the mask and the softmax) in every attention path: the torch reference
against transformers' eager formula written out, then the C kernel, the torch and C backends, and
the Triton one-pass and split-decode kernels (CUDA, or the interpreter with small grids) against
the reference, with sliding windows and sinks alongside. Queries are scaled up so that the
scores reach the cap: an implementation that ignored it would be far off."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.cpu_backend import CpuAttentionBackend
from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels import cpu_binding
from kernels.paged_attention import paged_attention_cpu, paged_attention_ref
from kernels.write_kv import write_kv_ref
from tests.kernels.paged_inputs import assert_close_to_reference, make_batch
from tests.worker.paged_batches import random_batch

CPU = torch.device("cpu")
needs_c = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")
CAP = 5.0  # the scores (std ~ QUERY_GAIN) reach well past it
QUERY_GAIN = 6.0
# (cached context, new queries): decodes, a fresh prompt, chunks after a context.
MIXED = [(40, 1), (0, 37), (3, 1), (21, 19), (70, 1), (55, 30)]


def _sinks(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(9)) * 2


def test_reference_equals_gemma2_eager_attention():
    """paged_attention_ref against transformers' Gemma 2 eager attention written out: scores
    scaled, divided by the cap, tanh, times the cap, then the causal sliding-window mask."""
    step, q, k, v, cache = random_batch([(25, 9)], 8, 2, 2, 16, seed=3)
    q = q * QUERY_GAIN
    window, scale = 11, 0.25
    ref = cache.clone()
    write_kv_ref(k, v, ref[0], ref[1], torch.from_numpy(step.slot_mapping))
    positions = torch.arange(34)
    blocks = torch.from_numpy(step.block_table[0]).long()[positions // 8]
    keys = ref[0][blocks, positions % 8].repeat_interleave(2, dim=1)  # [34, Hq, D]
    values = ref[1][blocks, positions % 8].repeat_interleave(2, dim=1)
    q_pos = torch.arange(25, 34)[:, None]
    visible = (positions <= q_pos) & (positions > q_pos - window)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = torch.tanh(scores / CAP) * CAP
    probs = torch.softmax(scores + torch.where(visible, 0.0, float("-inf")), dim=-1)
    expected = torch.einsum("hqk,khd->qhd", probs, values)
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    actual = paged_attention_ref(
        q, ref[0], ref[1], *tables, scale, sliding_window=window, logits_soft_cap=CAP
    )
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    uncapped = paged_attention_ref(q, ref[0], ref[1], *tables, scale, sliding_window=window)
    assert (uncapped - expected).abs().max() > 0.1, "the cap must matter in these tests"


def _cpu_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, bs, Hkv, D] caches -> the C kernel's keys [N, Hkv, D, bs] and values [N, Hkv, bs, D]."""
    return key_cache.permute(0, 2, 3, 1).contiguous(), value_cache.permute(0, 2, 1, 3).contiguous()


@needs_c
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (64, 3), (128, 8)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_c_kernel_matches_reference(head_dim, group, window, with_sinks):
    batch = make_batch(MIXED, 2, group, head_dim, 16, torch.float32, seed=group, device=CPU)
    query = batch["query"] * QUERY_GAIN
    sinks = _sinks(2 * group) if with_sinks else None
    tables = (batch["block_table"], batch["query_start_loc"], batch["seq_lens"])
    scale = head_dim**-0.5
    features = dict(sliding_window=window, sinks=sinks, logits_soft_cap=CAP)
    expected = paged_attention_ref(
        query, batch["key_cache"], batch["value_cache"], *tables, scale, **features
    )
    keys, values = _cpu_layout(batch["key_cache"], batch["value_cache"])
    actual = paged_attention_cpu(query, keys, values, *tables, scale, **features)
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)
    uncapped = paged_attention_cpu(query, keys, values, *tables, scale, sliding_window=window)
    assert (uncapped - expected).abs().max() > 0.1


@needs_c
def test_c_kernel_refuses_a_cap_that_is_not_positive():
    batch = make_batch([(5, 2)], 1, 2, 64, 16, torch.float32, device=CPU)
    keys, values = _cpu_layout(batch["key_cache"], batch["value_cache"])
    tables = (batch["block_table"], batch["query_start_loc"], batch["seq_lens"])
    with pytest.raises(ValueError, match="logits_soft_cap"):
        paged_attention_cpu(batch["query"], keys, values, *tables, 0.1, logits_soft_cap=0.0)


def _backend_output(backend_cls, step, q, k, v, cache, **features):
    if backend_cls is CpuAttentionBackend:
        n, bs, hkv, d = cache.shape[1:]
        kv_cache = torch.empty(CpuAttentionBackend.kv_cache_shape(n, bs, hkv, d))
        key_cache, value_cache = CpuAttentionBackend.split_cache(kv_cache)
        key_cache.copy_(cache[0].permute(0, 2, 3, 1))
        value_cache.copy_(cache[1].permute(0, 2, 1, 3))
    else:
        kv_cache = cache.clone()
    backend = backend_cls()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    return backend.forward(q, k, v, kv_cache, meta, q.shape[-1] ** -0.5, **features)


@pytest.mark.parametrize(
    "backend_cls",
    [
        pytest.param(TorchAttentionBackend, id="torch"),
        pytest.param(CpuAttentionBackend, id="c", marks=needs_c),
    ],
)
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_cpu_backends_match_reference(backend_cls, window, with_sinks):
    """Each CPU backend writes the step's K/V and attends with the cap (and a window, sinks)."""
    step, q, k, v, cache = random_batch(MIXED, 16, 2, 3, 64, seed=5)
    q = q * QUERY_GAIN
    features: dict[str, object] = {"logits_soft_cap": CAP}
    if window is not None:
        features["sliding_window"] = window
    if with_sinks:
        features["sinks"] = _sinks(6)
    ref = cache.clone()
    write_kv_ref(k, v, ref[0], ref[1], torch.from_numpy(step.slot_mapping))
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    expected = paged_attention_ref(q, ref[0], ref[1], *tables, q.shape[-1] ** -0.5, **features)  # type: ignore[arg-type]
    actual = _backend_output(backend_cls, step, q, k, v, cache, **features)
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


def test_torch_backend_takes_a_cap_far_below_the_scores():
    """Scores hundreds of times the cap: tanh saturates, nothing overflows."""
    step, q, k, v, cache = random_batch([(30, 4), (0, 9)], 16, 1, 2, 32, seed=2)
    q = q * 500.0
    ref = cache.clone()
    write_kv_ref(k, v, ref[0], ref[1], torch.from_numpy(step.slot_mapping))
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    scale = 32**-0.5
    expected = paged_attention_ref(q, ref[0], ref[1], *tables, scale, logits_soft_cap=0.5)
    actual = _backend_output(TorchAttentionBackend, step, q, k, v, cache, logits_soft_cap=0.5)
    assert actual.isfinite().all()
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


# The Triton kernels (imported here only: their module needs Triton).


def _triton_expected(batch, window, sinks, cap):
    scale = batch["query"].shape[-1] ** -0.5
    return paged_attention_ref(
        **batch,
        scale=scale,
        out_dtype=torch.float32,
        sliding_window=window,
        sinks=sinks,
        logits_soft_cap=cap,
    )


@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (17, True), (5, False)])
def test_triton_one_pass_matches_reference(window, with_sinks, device):
    from kernels.triton.paged_attention import paged_attention

    batch = make_batch(MIXED, 2, 3, 64, 16, torch.float32, seed=1, device=device)
    batch["query"] = batch["query"] * QUERY_GAIN
    sinks = _sinks(6).to(device) if with_sinks else None
    expected = _triton_expected(batch, window, sinks, CAP)
    scale = batch["query"].shape[-1] ** -0.5
    actual = paged_attention(
        **batch,
        scale=scale,
        max_query_len=37,
        sliding_window=window,
        sinks=sinks,
        logits_soft_cap=CAP,
    )
    assert_close_to_reference(actual, expected, torch.float32)
    uncapped = _triton_expected(batch, window, sinks, None)
    assert (uncapped - expected).abs().max() > 0.1


def test_triton_one_pass_saturates_without_overflow(device):
    from kernels.triton.paged_attention import paged_attention

    batch = make_batch([(20, 1), (0, 12)], 1, 2, 32, 16, torch.float32, seed=6, device=device)
    batch["query"] = batch["query"] * 500.0
    expected = _triton_expected(batch, None, None, 0.5)
    actual = paged_attention(**batch, scale=32**-0.5, logits_soft_cap=0.5)
    assert actual.isfinite().all()
    assert_close_to_reference(actual, expected, torch.float32)


@pytest.mark.parametrize(("window", "with_sinks"), [(None, True), (100, False)])
def test_triton_split_decode_matches_reference(window, with_sinks, device):
    from kernels.triton.paged_decode import paged_decode_split

    lens = [1, 65, 150, 300]
    batch = make_batch([(n - 1, 1) for n in lens], 1, 3, 64, 16, torch.float32, device=device)
    batch["query"] = batch["query"] * QUERY_GAIN
    sinks = _sinks(3).to(device) if with_sinks else None
    expected = _triton_expected(batch, window, sinks, CAP)
    actual = paged_decode_split(
        **batch,
        scale=64**-0.5,
        max_seq_len=300,
        partition_size=64,
        sliding_window=window,
        sinks=sinks,
        logits_soft_cap=CAP,
    )
    assert_close_to_reference(actual, expected, torch.float32)


def test_triton_kernels_refuse_a_cap_that_is_not_positive(device):
    from kernels.triton.paged_attention import paged_attention

    batch = make_batch([(5, 2)], 1, 2, 64, 16, torch.float32, device=device)
    with pytest.raises(AssertionError, match="logits_soft_cap must be positive"):
        paged_attention(**batch, scale=0.1, logits_soft_cap=-1.0)


def test_triton_backend_hands_the_cap_to_its_kernel(device):
    from gpu_worker.attention.triton_backend import TritonAttentionBackend

    batch = make_batch([(30, 1), (0, 9)], 1, 2, 32, 16, torch.float32, seed=8, device=device)
    batch["query"] = batch["query"] * QUERY_GAIN
    q_lens = (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()
    meta = DeviceBatch(
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch["seq_lens"],
        block_table=batch["block_table"],
        slot_mapping=torch.full((batch["query"].shape[0],), -1, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=int(batch["seq_lens"].max()),
    )
    kv_cache = torch.stack([batch["key_cache"], batch["value_cache"]])
    empty = batch["query"].new_empty(batch["query"].shape[0], 1, 32)
    out = TritonAttentionBackend().forward(
        batch["query"], empty, empty, kv_cache, meta, 32**-0.5, logits_soft_cap=CAP
    )
    assert_close_to_reference(out, _triton_expected(batch, None, None, CAP), torch.float32)
