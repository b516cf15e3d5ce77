"""Plain PyTorch references for the KV-cache kernels; slow but obviously correct. They run on the
device of the tensors they are given."""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are
    skipped."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[t]
        value_cache[block, offset] = value[t]


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each request's packed queries over its paged K/V, computed in fp32;
    the result is on query's device, in out_dtype (default: query's dtype)."""
    device = query.device
    num_q_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=device)
        blocks = block_table[i].to(device).long()[positions // block_size]
        offsets = positions % block_size
        # [seq_len, Hkv, D] -> [Hq, seq_len, D]
        k = key_cache[blocks, offsets].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value_cache[blocks, offsets].float().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_start:q_end].float().transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        allowed = positions[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
