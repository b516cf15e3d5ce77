"""paged_attention (Triton) must match paged_attention_ref, which must match dense attention."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.paged_attention import paged_attention_ref
from kernels.triton.paged_attention import paged_attention
from tests.kernels.paged_inputs import assert_close_to_reference, cuda_only, make_batch

__all__ = ["make_batch"]  # tests/kernels/test_cpu_kernels.py imports it from here


def check(batch: dict[str, torch.Tensor], **kwargs) -> None:
    scale = batch["query"].shape[-1] ** -0.5
    expected = paged_attention_ref(**batch, scale=scale, out_dtype=torch.float32)
    actual = paged_attention(**batch, scale=scale, **kwargs)
    assert_close_to_reference(actual, expected, batch["query"].dtype)


def test_reference_matches_dense_attention(device):
    ctx, q_len, num_kv_heads, group, head_dim, block_size = 37, 11, 2, 3, 16, 8
    batch = make_batch(
        [(ctx, q_len)], num_kv_heads, group, head_dim, block_size, torch.float32, device=device
    )
    seq_len = ctx + q_len
    positions = torch.arange(seq_len, device=device)
    blocks = batch["block_table"][0].long()[positions // block_size]
    k = batch["key_cache"][blocks, positions % block_size]  # contiguous [seq_len, Hkv, D]
    v = batch["value_cache"][blocks, positions % block_size]
    scale = head_dim**-0.5

    expected = torch.empty_like(batch["query"])
    for h in range(num_kv_heads * group):
        q = batch["query"][:, h]
        scores = q @ k[:, h // group].T * scale
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(diagonal=ctx)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        expected[:, h] = probs @ v[:, h // group]

    actual = paged_attention_ref(**batch, scale=scale)
    assert actual.device == batch["query"].device
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_at_block_boundaries(block_size, device):
    lens = [
        block_size - 1,
        block_size,
        block_size + 1,
        2 * block_size - 1,
        2 * block_size,
        2 * block_size + 1,
    ]
    batch = make_batch(
        [(n - 1, 1) for n in lens], 1, 2, 64, block_size, torch.float32, device=device
    )
    check(batch, max_query_len=1)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_at_block_boundaries(block_size, device):
    requests = [
        (0, block_size - 1),
        (0, block_size),
        (0, block_size + 1),
        (block_size, block_size + 1),
    ]
    check(make_batch(requests, 1, 1, 64, block_size, torch.float32, device=device))


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_gqa(group, head_dim, device):
    requests = [(20, 9), (33, 1), (0, 17), (47, 1)]
    check(make_batch(requests, 2, group, head_dim, 16, torch.float32, seed=group, device=device))


def test_long_chunk_after_long_context(device):
    check(make_batch([(300, 100), (150, 1)], 1, 3, 64, 32, torch.float32, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    # On the CPU the interpreter upcasts 16-bit operands; CUDA runs the 16-bit tl.dot.
    requests = [(40, 1), (17, 23), (0, 5)]
    check(make_batch(requests, 2, 4, 128, 16, dtype, device=device))


@cuda_only("16-bit tl.dot on tensor cores, and shapes too large for the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_mixed_batch_on_cuda(dtype, device):
    rng = random.Random(7)
    requests = [(rng.randint(0, 3000), rng.choice([1, 1, 1, 64, 700])) for _ in range(24)]
    check(
        make_batch(requests, 8, 4, 128, 16, dtype, seed=3, device=device),
        max_query_len=max(q for _, q in requests),
    )


def test_random_shapes(device):
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
            device=device,
        )
        check(batch, max_query_len=max(q for _, q in requests))


def test_writes_into_out(device):
    batch = make_batch([(5, 3), (0, 1)], 1, 1, 64, 16, torch.float32, device=device)
    out = torch.full_like(batch["query"], float("nan"))
    result = paged_attention(**batch, scale=0.125, out=out)
    assert result is out
    torch.testing.assert_close(out, paged_attention_ref(**batch, scale=0.125), rtol=2e-5, atol=2e-5)


def test_rejects_head_dims_outside_the_padded_range(device):
    # 80 and 96 run padded (tests/kernels/test_head_padding_triton.py); 100 and 264 do not.
    for head_dim in (100, 264):
        batch = make_batch([(0, 2)], 1, 1, head_dim, 16, torch.float32, device=device)
        with pytest.raises(AssertionError, match="head_dim must be a multiple of 8 from 16 to 256"):
            paged_attention(**batch, scale=0.1)
