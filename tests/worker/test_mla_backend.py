"""The MLA backends (gpu_worker/attention/mla_backend.py, torch; mla_triton_backend.py, the
Triton kernel, under the interpreter on the CPU) against dense multi-head attention.

A step of decodes and prefill chunks (some with context cached by earlier steps) over a paged
latent cache with scattered blocks: the absorbed form the backend runs, [q_nope W_UK | q_pe]
against the cached [c_kv | k_pe] and the result through W_UV, equals per-head attention over the
decompressed keys [c_kv W_UK^T | k_pe] and values c_kv W_UV^T, request by request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.attention.mla_backend import MLATorchBackend
from gpu_worker.attention.mla_triton_backend import MLATritonBackend

BACKENDS = [MLATorchBackend, MLATritonBackend]

HEADS, RANK, ROPE, NOPE, V = 4, 32, 16, 24, 20
BLOCK = 8
SCALE = (NOPE + ROPE) ** -0.5


def _step(cached: list[int], new: list[int], num_blocks: int, gen: torch.Generator) -> StepBatch:
    """Requests with `cached` tokens already in the cache and `new` tokens this step, their
    blocks drawn at random from the pool."""
    seq_lens = np.array([c + n for c, n in zip(cached, new, strict=True)], dtype=np.int32)
    max_blocks = int(-(-seq_lens.max() // BLOCK))
    order = torch.randperm(num_blocks, generator=gen).numpy()
    table = order[: len(new) * max_blocks].reshape(len(new), max_blocks).astype(np.int32)
    positions = [np.arange(c, c + n) for c, n in zip(cached, new, strict=True)]
    slots = np.concatenate(
        [table[i, p // BLOCK].astype(np.int64) * BLOCK + p % BLOCK for i, p in enumerate(positions)]
    )
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return StepBatch(qsl, seq_lens, table, slots, BLOCK)


def _dense_reference(q_nope, q_pe, latent_ctx, w_uk, w_uv, q_pos):
    """Per-head attention of one request's queries over its decompressed context."""
    c_kv, k_pe = latent_ctx[:, :RANK], latent_ctx[:, RANK:]
    keys = torch.cat(
        [torch.einsum("sr,hnr->hsn", c_kv, w_uk), k_pe.expand(HEADS, -1, -1)], dim=-1
    )  # [H, S, NOPE + ROPE]
    values = torch.einsum("sr,hvr->hsv", c_kv, w_uv)  # [H, S, V]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Lq, NOPE + ROPE]
    scores = q @ keys.transpose(1, 2) * SCALE
    causal = torch.arange(latent_ctx.shape[0])[None, :] <= torch.as_tensor(q_pos)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # [Lq, H, V]


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize(
    ("cached", "new"),
    [
        ([0], [1]),  # one token
        ([5, 0, 12, 30], [1, 9, 1, 4]),  # decodes and chunks, some after cached context
        ([0, 0], [17, 3]),  # prefill only
        ([3, 8, 40], [1, 1, 1]),  # decodes only, different context lengths
    ],
)
def test_absorbed_latent_attention_equals_dense_attention(backend_cls, cached, new):
    gen = torch.Generator().manual_seed(sum(cached) + sum(new))
    num_blocks = 64
    backend = backend_cls()
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK, 1, RANK + ROPE))
    step = _step(cached, new, num_blocks, gen)
    total = [c + n for c, n in zip(cached, new, strict=True)]
    # Every request's whole sequence of latent vectors; the cached part written beforehand.
    seqs = [torch.randn(n, RANK + ROPE, generator=gen) for n in total]
    flat = cache.view(-1, RANK + ROPE)
    for i, c in enumerate(cached):
        pos = np.arange(c)
        flat[step.block_table[i, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK] = seqs[i][:c]
    tokens = sum(new)
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen)
    w_kv = torch.randn(HEADS, NOPE + V, RANK, generator=gen) / RANK**0.5
    w_uk, w_uv = w_kv[:, :NOPE], w_kv[:, NOPE:]
    new_latent = torch.cat([s[c:] for s, c in zip(seqs, cached, strict=True)]).unsqueeze(1)

    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    meta = backend.build(step, DeviceBatch.from_step(step, torch.device("cpu")), cache.device)
    out_latent = backend.forward(q, new_latent, new_latent[..., :RANK], cache, meta, SCALE)
    assert out_latent.shape == (tokens, HEADS, RANK)
    out = torch.einsum("thr,hvr->thv", out_latent, w_uv)

    # The step's latent vectors are in the cache, at their slots.
    torch.testing.assert_close(flat[torch.from_numpy(step.slot_mapping)], new_latent[:, 0])
    start = 0
    for i, (c, n) in enumerate(zip(cached, new, strict=True)):
        rows = slice(start, start + n)
        expected = _dense_reference(q_nope[rows], q_pe[rows], seqs[i], w_uk, w_uv, range(c, c + n))
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-4)
        start += n


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_values_must_be_the_latent_part_of_one_kv_head(backend_cls):
    backend = backend_cls()
    cache = torch.zeros(backend.kv_cache_shape(4, BLOCK, 1, RANK + ROPE))
    step = _step([0], [2], 4, torch.Generator().manual_seed(0))
    meta = backend.build(step, DeviceBatch.from_step(step, torch.device("cpu")), cache.device)
    q = torch.randn(2, HEADS, RANK + ROPE)
    two_heads = torch.randn(2, 2, RANK + ROPE)
    with pytest.raises(ValueError, match="one latent vector per token"):
        backend.forward(q, two_heads, two_heads[..., :RANK], cache, meta, SCALE)
