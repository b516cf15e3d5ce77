"""write_kv (Triton) must match write_kv_ref, including skipped padding slots."""

from __future__ import annotations

import pytest
import torch

from kernels.triton.write_kv import write_kv
from kernels.write_kv import write_kv_ref


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,dtype",
    [
        (7, 2, 64, 16, torch.float32),
        (33, 1, 128, 32, torch.bfloat16),
        (5, 3, 80, 16, torch.float16),
    ],
)
def test_write_kv_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype, device):
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = 8
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype).to(device)
    expected = kv_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens
    slots = slots.to(device)

    write_kv(key, value, kv_cache[0], kv_cache[1], slots)
    write_kv_ref(key, value, expected[0], expected[1], slots)

    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)


def test_write_kv_strided_input(device):
    # Keys/values sliced out of a fused qkv projection are not contiguous per token.
    num_tokens, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, device=device)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    kv_cache = torch.zeros(2, 4, block_size, num_kv_heads, head_dim, device=device)
    expected = kv_cache.clone()
    slots = torch.tensor([0, 17, 63, -1, 5, 32], device=device)

    write_kv(key, value, kv_cache[0], kv_cache[1], slots)
    write_kv_ref(key, value, expected[0], expected[1], slots)

    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)
