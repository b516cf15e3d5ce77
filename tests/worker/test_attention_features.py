"""Sliding windows and attention sinks (issue 30, item 4) in the CPU attention backends: the
reference against dense attention with an explicit mask and sink, each backend against the
reference (windows smaller than, equal to and larger than the context; decodes, prefills and
mixed steps; GQA; with and without sinks), blocks before every window never read (they hold
NaN), and the per-layer window as transformers decides it."""

from __future__ import annotations

import pytest
import torch

from config.attention import AttentionFeatures
from config.model_arch import ModelArchConfig
from gpu_worker.attention.cpu_backend import CpuAttentionBackend
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels import cpu_binding
from kernels.paged_attention import paged_attention_ref
from kernels.write_kv import write_kv_ref
from tests.worker.paged_batches import random_batch

CPU = torch.device("cpu")
needs_c = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

# (cached context, new queries): decodes, a fresh prompt, chunks after a context, all mixed.
MIXED = [(40, 1), (0, 37), (3, 1), (21, 19), (70, 1), (55, 30)]


def _unread_blocks(step: StepBatch, window: int | None) -> list[int]:
    """Blocks wholly before the window of each request's first query: no backend may read them."""
    if window is None:
        return []
    blocks = []
    for i, seq_len in enumerate(step.seq_lens):
        q_len = int(step.query_start_loc[i + 1] - step.query_start_loc[i])
        oldest = int(seq_len) - q_len - window + 1
        blocks += [int(b) for b in step.block_table[i, : max(oldest, 0) // step.block_size]]
    return blocks


def _expected(step, q, k, v, cache, window, sinks):
    ref = cache.clone()
    write_kv_ref(k, v, ref[0], ref[1], torch.from_numpy(step.slot_mapping))
    tables = (step.block_table, step.query_start_loc, step.seq_lens)
    return paged_attention_ref(
        q,
        ref[0],
        ref[1],
        *(torch.from_numpy(a) for a in tables),
        q.shape[-1] ** -0.5,
        sliding_window=window,
        sinks=sinks,
    )


def _run(backend_cls, step, q, k, v, cache, window, sinks):
    """The backend's output, its cache in its own layout with the unread blocks poisoned."""
    poisoned = cache.clone()
    unread = _unread_blocks(step, window)
    poisoned[:, unread] = float("nan")
    if backend_cls is CpuAttentionBackend:
        n, bs, hkv, d = cache.shape[1:]
        kv_cache = torch.empty(CpuAttentionBackend.kv_cache_shape(n, bs, hkv, d))
        key_cache, value_cache = CpuAttentionBackend.split_cache(kv_cache)
        key_cache.copy_(poisoned[0].permute(0, 2, 3, 1))
        value_cache.copy_(poisoned[1].permute(0, 2, 1, 3))
    else:
        kv_cache = poisoned
    backend = backend_cls()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    features: dict[str, object] = {}
    if window is not None:
        features["sliding_window"] = window
    if sinks is not None:
        features["sinks"] = sinks
    return backend.forward(q, k, v, kv_cache, meta, q.shape[-1] ** -0.5, **features)


def _check(backend_cls, requests, window, with_sinks, *, block_size=16, kv=2, group=3, dim=64):
    step, q, k, v, cache = random_batch(requests, block_size, kv, group, dim, seed=len(requests))
    sinks = torch.randn(kv * group, generator=torch.Generator().manual_seed(7)) * 2
    sinks = sinks if with_sinks else None
    expected = _expected(step, q, k, v, cache, window, sinks)
    actual = _run(backend_cls, step, q, k, v, cache, window, sinks)
    assert not actual.isnan().any(), "a block before the window was read"
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


def test_reference_equals_dense_attention_with_mask_and_sinks():
    """paged_attention_ref against transformers' gpt-oss eager attention, written out: scores,
    a sliding-window causal mask, the sink appended as a last logit and dropped after softmax."""
    step, q, k, v, cache = random_batch([(25, 9)], 8, 2, 2, 16, seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    window, scale = 6, 0.25
    ref = cache.clone()
    write_kv_ref(k, v, ref[0], ref[1], torch.from_numpy(step.slot_mapping))
    positions = torch.arange(34)
    blocks = torch.from_numpy(step.block_table[0]).long()[positions // 8]
    keys = ref[0][blocks, positions % 8].repeat_interleave(2, dim=1)  # [34, Hq, D]
    values = ref[1][blocks, positions % 8].repeat_interleave(2, dim=1)
    q_pos = torch.arange(25, 34)[:, None]
    visible = (positions <= q_pos) & (positions > q_pos - window)  # [9, 34]
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = scores + torch.where(visible, 0.0, float("-inf"))
    logits = torch.cat([scores, sinks[:, None, None].expand(-1, 9, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    expected = torch.einsum("hqk,khd->qhd", probs, values)
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    actual = paged_attention_ref(q, ref[0], ref[1], *tables, scale, None, window, sinks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # The window and the sink both change the result.
    plain = paged_attention_ref(q, ref[0], ref[1], *tables, scale)
    assert (plain - expected).abs().max() > 1e-2


BACKENDS = [
    pytest.param(TorchAttentionBackend, id="torch"),
    pytest.param(CpuAttentionBackend, id="c", marks=needs_c),
]


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [None, 1, 5, 17, 40, 85, 200])
def test_mixed_step(backend_cls, window, with_sinks):
    # 85 is the longest context (55 + 30): windows below, at and above the contexts.
    _check(backend_cls, MIXED, window, with_sinks)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("window", [4, 16, 33, 64])
def test_decodes_only(backend_cls, window):
    requests = [(15, 1), (16, 1), (47, 1), (200, 1), (3, 1), (64, 1)]
    _check(backend_cls, requests, window, True, group=1, kv=4)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("window", [3, 32, 100])
def test_long_prefill_over_several_tiles(backend_cls, window):
    # 150 queries: several of the C kernel's query tiles, each starting at its own window.
    _check(backend_cls, [(0, 150), (90, 70)], window, False, group=8, kv=1, block_size=32)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("dim", [64, 128])
def test_gqa_groups_and_head_sizes(backend_cls, dim):
    for group in (1, 2, 5):
        _check(backend_cls, MIXED, 9, True, group=group, dim=dim)


@pytest.mark.parametrize("dim", [16, 32, 80])
def test_torch_backend_takes_other_head_sizes(dim):
    _check(TorchAttentionBackend, MIXED, 7, True, dim=dim, block_size=8)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_layers_of_one_step_with_different_windows(backend_cls):
    """gpt-oss alternates windowed and full layers: one step's metadata serves both, in either
    order, and each layer gets its own window."""
    step, q, k, v, cache = random_batch(MIXED, 16, 2, 2, 64, seed=11)
    backend = backend_cls()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    for window in (8, None, 8, 30, None):
        expected = _expected(step, q, k, v, cache, window, None)
        poisoned = cache.clone()
        if backend_cls is CpuAttentionBackend:
            n, bs, hkv, d = cache.shape[1:]
            kv_cache = torch.empty(backend.kv_cache_shape(n, bs, hkv, d))
            key_cache, value_cache = backend.split_cache(kv_cache)
            key_cache.copy_(poisoned[0].permute(0, 2, 3, 1))
            value_cache.copy_(poisoned[1].permute(0, 2, 1, 3))
        else:
            kv_cache = poisoned
        features = {} if window is None else {"sliding_window": window}
        actual = backend.forward(q, k, v, kv_cache, meta, 64**-0.5, **features)
        torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


@needs_c
def test_c_kernel_refuses_sinks_of_the_wrong_shape():
    from kernels.paged_attention import paged_attention_cpu

    step, q, k, v, cache = random_batch([(5, 2)], 16, 1, 2, 64, seed=0)
    key_cache = cache[0].permute(0, 2, 3, 1).contiguous()
    value_cache = cache[1].permute(0, 2, 1, 3).contiguous()
    tables = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    with pytest.raises(ValueError, match="sinks"):
        paged_attention_cpu(q, key_cache, value_cache, *tables, 0.1, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_cpu(q, key_cache, value_cache, *tables, 0.1, sliding_window=0)


# Per-layer windows, against the window transformers gives each layer.


def _hf_layer_windows(model_type: str, **fields) -> list[int | None]:
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:  # Mistral: every layer slides by config.sliding_window
        return [cfg.sliding_window] * cfg.num_hidden_layers
    return [cfg.sliding_window if kind == "sliding_attention" else None for kind in kinds]


LAYER_CASES = [
    ("mistral", {"sliding_window": 8}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen2", {"sliding_window": 8, "use_sliding_window": False, "max_window_layers": 2}),
    ("qwen3", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3}),
    ("qwen3", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}),
    ("gpt_oss", {"sliding_window": 8}),
    (
        "gpt_oss",
        {"sliding_window": 8, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2},
    ),
]


@pytest.mark.parametrize(("model_type", "fields"), LAYER_CASES)
def test_layer_windows_are_transformers(model_type, fields, tmp_path):
    import transformers

    fields = {"num_hidden_layers": 4, **fields}
    expected = _hf_layer_windows(model_type, **fields)
    # As saved to config.json (transformers 5 writes layer_types where its config has them).
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    cfg.architectures = ["X"]
    arch = ModelArchConfig.from_dict(cfg.to_dict())
    assert [arch.layer_sliding_window(i) for i in range(4)] == expected
    assert arch.sliding_window == next((w for w in expected if w is not None), None)


def test_qwen2_config_without_layer_types_slides_from_max_window_layers():
    base = dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=4,
        intermediate_size=128,
        vocab_size=512,
        sliding_window=16,
        use_sliding_window=True,
        max_window_layers=1,
    )
    arch = ModelArchConfig.from_dict(base)
    assert [arch.layer_sliding_window(i) for i in range(4)] == [None, 16, 16, 16]


def test_gpt_oss_needs_sinks_and_other_families_do_not():
    """Keyed by architecture, as GptOssForCausalLM turns its sinks on (SINK_ARCHITECTURES)."""

    def arch(architecture):
        return ModelArchConfig.from_dict(
            dict(
                architectures=[architecture],
                hidden_size=64,
                num_attention_heads=4,
                num_hidden_layers=2,
                intermediate_size=128,
                vocab_size=512,
            )
        )

    assert AttentionFeatures.of(arch("GptOssForCausalLM"), 4096).sinks
    assert not AttentionFeatures.of(arch("LlamaForCausalLM"), 4096).sinks


def test_every_backend_is_chosen_for_windows_and_sinks():
    from config.attention import attention_backends_for
    from gpu_worker.attention.select import attention_backend

    both = AttentionFeatures(sliding_window=True, sinks=True)
    assert attention_backends_for("cuda", 16, 128, "bfloat16", both) == ["triton"]
    assert attention_backends_for("cpu", 16, 64, "float32", both) == ["cpu", "torch"]
    assert attention_backends_for("cpu", 16, 80, "float32", both) == ["torch"]
    expected = "cpu" if cpu_binding.available() else "torch"
    assert attention_backend(CPU, torch.float32, 64, 16, both).name == expected
