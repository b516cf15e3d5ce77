"""The CPU attention backend (TorchAttentionBackend) against the plain PyTorch reference.

Batches are built by hand, as the input batch would build them (tests/worker/paged_batches.py):
requests packed one after another, each with some context already in the paged cache and this
step's query tokens, blocks handed out in shuffled order, the block table padded with -1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from kernels.paged_attention import paged_attention_ref
from kernels.write_kv import write_kv_ref
from tests.worker.paged_batches import random_batch

CPU = torch.device("cpu")


def _check(
    requests, block_size=16, num_kv_heads=2, group=1, head_dim=16, dtype=torch.float32, seed=0
):
    step, q, k, v, kv_cache = random_batch(
        requests, block_size, num_kv_heads, group, head_dim, seed, dtype
    )
    scale = head_dim**-0.5
    ref_cache = kv_cache.clone()
    write_kv_ref(k, v, ref_cache[0], ref_cache[1], torch.from_numpy(step.slot_mapping))
    expected = paged_attention_ref(
        q,
        ref_cache[0],
        ref_cache[1],
        torch.from_numpy(step.block_table),
        torch.from_numpy(step.query_start_loc),
        torch.from_numpy(step.seq_lens),
        scale,
    )

    backend = TorchAttentionBackend()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    out = backend.forward(q, k, v, kv_cache, meta, scale)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(kv_cache, ref_cache), "K/V written to the wrong slots"
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - expected.float()).abs().max().item()
    assert err < atol, f"max error {err} for requests {requests}"


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_gqa_mixed_decode_and_prefill_after_context(group, num_kv_heads):
    # Decodes and prefill chunks interleaved, so neither group is contiguous in the packed batch.
    requests = [(17, 1), (0, 9), (31, 1), (16, 16), (5, 1), (33, 20), (0, 1), (47, 2)]
    _check(requests, num_kv_heads=num_kv_heads, group=group, seed=group * 10 + num_kv_heads)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_lengths_around_block_boundaries(block_size):
    b = block_size
    requests = [
        (b - 1, 1),
        (b, 1),
        (b + 1, 1),
        (2 * b - 1, 1),
        (0, b),
        (0, b + 1),
        (b - 1, 2),
        (b, b),
        (2 * b, b - 1 or 1),
        (0, 2 * b + 1),
        (b + 1, 2 * b),
    ]
    _check(requests, block_size=block_size, group=2, seed=block_size)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(seed):
    rng = np.random.default_rng(1000 + seed)
    block_size = int(rng.choice([8, 16, 32]))
    group = int(rng.choice([1, 3, 8]))
    num_kv_heads = int(rng.integers(1, 4))
    head_dim = int(rng.choice([16, 32, 64]))
    requests = []
    for _ in range(int(rng.integers(1, 9))):
        ctx = int(rng.integers(0, 3 * block_size + 2))
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(1, 2 * block_size + 3))
        requests.append((ctx, q_len))
    _check(
        requests,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        seed=seed,
    )


def test_single_token_batch():
    _check([(0, 1)])


def test_single_decode_after_context():
    _check([(40, 1)], group=3)


def test_decodes_with_equal_lengths():
    # The decode group needs no mask when every request has the same length.
    _check([(20, 1)] * 5, group=8, num_kv_heads=1)


def test_decodes_with_different_lengths():
    _check([(20, 1), (3, 1), (0, 1), (47, 1), (16, 1)], group=3)


def test_only_prefills_from_scratch():
    # One group covering the whole batch in order: the backend's identity fast path.
    _check([(0, 7), (0, 16), (0, 33), (0, 2)], group=2)


def test_only_prefill_chunks_after_context():
    _check([(16, 7), (3, 16), (40, 33), (1, 2)], group=3)


def test_one_long_prefill():
    _check([(0, 150)], group=8, num_kv_heads=1, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _check([(17, 1), (0, 9), (31, 1), (16, 16), (33, 20)], group=3, dtype=dtype)


def test_metadata_is_reused_across_layers():
    """build() runs once per step; every layer's forward reuses it with its own cache."""
    requests = [(17, 1), (0, 9), (31, 4)]
    step, q, k, v, cache0 = random_batch(requests, 16, 2, 3, 16, seed=5)
    _, q1, k1, v1, cache1 = random_batch(requests, 16, 2, 3, 16, seed=6)
    backend = TorchAttentionBackend()
    meta = backend.build(step, DeviceBatch.from_step(step, CPU), CPU)
    args = [torch.from_numpy(a) for a in (step.block_table, step.query_start_loc, step.seq_lens)]
    for q_, k_, v_, cache in ((q, k, v, cache0), (q1, k1, v1, cache1)):
        ref_cache = cache.clone()
        write_kv_ref(k_, v_, ref_cache[0], ref_cache[1], torch.from_numpy(step.slot_mapping))
        expected = paged_attention_ref(q_, ref_cache[0], ref_cache[1], *args, 0.25)
        out = backend.forward(q_, k_, v_, cache, meta, 0.25)
        assert torch.allclose(out, expected, atol=1e-5)
