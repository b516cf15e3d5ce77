"""Shared inputs for the Triton kernel tests: the device they run on (CUDA when there is a GPU,
else the CPU under Triton's interpreter), random paged batches, and dtype tolerances."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Against fp32 references computed from the same (rounded) inputs.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cuda_only(reason: str) -> pytest.MarkDecorator:
    """Skips a test on the CPU (interpreter), saying why it needs CUDA."""
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs CUDA: {reason}")


def make_batch(
    requests: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = DEVICE,
) -> dict[str, torch.Tensor]:
    """Random paged inputs on device for requests given as (cached context length, new query
    length): query [T, Hq, D], key_cache/value_cache [N, block_size, Hkv, D], block_table with
    shuffled (non-contiguous) blocks, query_start_loc, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [(ctx + q + block_size - 1) // block_size for ctx, q in requests]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype)
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
    return {name: t.to(device) for name, t in batch.items()}


def assert_close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype
) -> None:
    """actual is a dtype tensor of expected's shape (an fp32 reference), within dtype's
    tolerance of it."""
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
