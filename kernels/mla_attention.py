"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over a paged latent cache, for
mixed prefill/decode batches: mla_attention, the Triton kernel, and write_latent, the cache write
by slot mapping (both in kernels/triton/mla_attention.py); here mla_attention_ref, the slow torch
reference the tests compare both against.

The cache holds one vector per token, [c_kv | k_pe] (latent_dim + rope_dim elements), in blocks:
[num_blocks, block_size, latent_dim + rope_dim]. A query row [q_latent | q_pe] (each head's no-rope
query already taken through W_UK) scores every cached vector of its request; the values are the
vectors' c_kv part, so the output is [T, H, latent_dim] (W_UV is the caller's). All heads share
the one cached vector, so a program holds a block of heads of one query tile and reads each
key tile once for all of them.
"""

from __future__ import annotations

import torch


def mla_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """The reference, one request at a time in fp32: [T, H, latent_dim]."""
    block_size = cache.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    for i in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        seq_len = int(seq_lens[i])
        if end == start:
            continue
        pos = torch.arange(seq_len, device=q.device)
        ctx = cache[block_table[i, pos // block_size].long(), pos % block_size].float()
        scores = torch.einsum("thd,sd->hts", q[start:end].float(), ctx) * scale
        q_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hts,sd->thd", probs, ctx[:, :latent_dim]).to(q.dtype)
    return out
