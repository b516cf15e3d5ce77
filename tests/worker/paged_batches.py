"""Random paged-attention steps for backend tests, built by hand as the input batch builds them.

Requests are packed one after another (query_start_loc), each with some context already in the
paged cache and this step's queries (seq_lens = context + queries); their blocks are handed out
in shuffled order from a pool with a few blocks nobody owns, and the block table is padded with
-1 so that a read past a request's blocks fails loudly.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention.metadata import StepBatch

SPARE_BLOCKS = 3  # blocks in the pool that no request owns
TABLE_PAD = 2  # -1 columns after the longest request's blocks


def random_batch(
    requests: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[StepBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """requests: (cached context length, query length) each. The step, q [T, Hkv*group, D],
    k and v [T, Hkv, D], and a cache [2, blocks, block_size, Hkv, D] (the torch layout) random
    everywhere: the cached context, and garbage in the slots the step must not read."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = np.array([ctx + q for ctx, q in requests], dtype=np.int32)
    q_lens = np.array([q for _, q in requests], dtype=np.int32)
    blocks_per_req = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + SPARE_BLOCKS
    ids = rng.permutation(num_blocks)
    block_table = np.full((len(requests), max(blocks_per_req) + TABLE_PAD), -1, dtype=np.int32)
    taken = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = ids[taken : taken + n]
        taken += n
    query_start_loc = np.zeros(len(requests) + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(q_lens)
    positions = np.concatenate([np.arange(ctx, ctx + q) for ctx, q in requests])
    req_of_token = np.repeat(np.arange(len(requests)), q_lens)
    slot_mapping = (
        block_table[req_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    step = StepBatch(query_start_loc, seq_lens, block_table, slot_mapping, block_size)

    tokens, num_heads = int(query_start_loc[-1]), num_kv_heads * group
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(*shape, generator=gen).to(dtype)
    return step, q, k, v, kv_cache
