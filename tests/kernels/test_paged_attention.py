"""paged_attention (Triton) must match paged_attention_ref, which must match dense attention."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.paged_attention import paged_attention
from kernels.reference import paged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(
    requests: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random paged inputs for requests given as (cached context length, new query length)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [(ctx + q + block_size - 1) // block_size for ctx, q in requests]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Shuffled ids make every request's blocks non-contiguous; unused entries point past the cache.
    ids = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(requests), max_blocks), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = ids[used : used + n]
        used += n
    q_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    query = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    batch = {
        "query": query,
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "block_table": block_table,
        "query_start_loc": torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32),
        "seq_lens": torch.tensor([ctx + q for ctx, q in requests], dtype=torch.int32),
    }
    return {name: t.to(DEVICE) for name, t in batch.items()}


def check(batch: dict[str, torch.Tensor], **kwargs) -> None:
    scale = batch["query"].shape[-1] ** -0.5
    expected = paged_attention_ref(**batch, scale=scale)
    actual = paged_attention(**batch, scale=scale, **kwargs)
    assert actual.dtype == batch["query"].dtype and actual.shape == batch["query"].shape
    tol = TOLERANCE[batch["query"].dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def test_reference_matches_dense_attention():
    ctx, q_len, num_kv_heads, group, head_dim, block_size = 37, 11, 2, 3, 16, 8
    batch = make_batch([(ctx, q_len)], num_kv_heads, group, head_dim, block_size, torch.float32)
    seq_len = ctx + q_len
    positions = torch.arange(seq_len, device=DEVICE)
    blocks = batch["block_table"][0].long()[positions // block_size]
    k = batch["key_cache"][blocks, positions % block_size]  # contiguous [seq_len, Hkv, D]
    v = batch["value_cache"][blocks, positions % block_size]
    scale = head_dim**-0.5

    expected = torch.empty_like(batch["query"])
    for h in range(num_kv_heads * group):
        q = batch["query"][:, h]
        scores = q @ k[:, h // group].T * scale
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=DEVICE).tril(diagonal=ctx)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        expected[:, h] = probs @ v[:, h // group]

    actual = paged_attention_ref(**batch, scale=scale)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_at_block_boundaries(block_size):
    lens = [block_size - 1, block_size, block_size + 1, 2 * block_size - 1, 2 * block_size, 2 * block_size + 1]
    batch = make_batch([(n - 1, 1) for n in lens], 1, 2, 64, block_size, torch.float32)
    check(batch, max_query_len=1)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_at_block_boundaries(block_size):
    requests = [(0, block_size - 1), (0, block_size), (0, block_size + 1), (block_size, block_size + 1)]
    check(make_batch(requests, 1, 1, 64, block_size, torch.float32))


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_gqa(group, head_dim):
    requests = [(20, 9), (33, 1), (0, 17), (47, 1)]
    check(make_batch(requests, 2, group, head_dim, 16, torch.float32, seed=group))


def test_long_chunk_after_long_context():
    check(make_batch([(300, 100), (150, 1)], 1, 3, 64, 32, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    requests = [(40, 1), (17, 23), (0, 5)]
    check(make_batch(requests, 2, 4, 128, 16, dtype))


def test_random_shapes():
    rng = random.Random(1234)
    for seed in range(3):
        requests = [(rng.randint(0, 70), rng.randint(1, 20)) for _ in range(rng.randint(1, 3))]
        batch = make_batch(
            requests,
            num_kv_heads=rng.choice([1, 2]),
            group=rng.choice([1, 2, 3, 5, 8]),
            head_dim=rng.choice([32, 64, 128]),
            block_size=rng.choice([16, 32]),
            dtype=torch.float32,
            seed=seed,
        )
        check(batch, max_query_len=max(q for _, q in requests))


def test_writes_into_out():
    batch = make_batch([(5, 3), (0, 1)], 1, 1, 64, 16, torch.float32)
    out = torch.full_like(batch["query"], float("nan"))
    result = paged_attention(**batch, scale=0.125, out=out)
    assert result is out
    torch.testing.assert_close(out, paged_attention_ref(**batch, scale=0.125), rtol=2e-5, atol=2e-5)


def test_rejects_non_power_of_two_head_dim():
    batch = make_batch([(0, 2)], 1, 1, 80, 16, torch.float32)
    with pytest.raises(AssertionError, match="head_dim must be a power of two"):
        paged_attention(**batch, scale=0.1)
