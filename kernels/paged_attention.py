"""Causal attention over a paged KV cache for mixed prefill/decode batches, three ways side by side:
paged_attention, the Triton flash-attention kernel (kernels/triton/paged_attention.py; the cache as
[num_blocks, block_size, Hkv, D]), whose input checks are here; paged_attention_cpu, the C kernel
(kernels/cpu/paged_attention.c, fp32, the CPU backend's layout with each block's keys transposed);
and paged_attention_ref, the slow torch reference the tests compare both against. The attention
backends pick theirs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.cpu_binding import check_cpu, check_rows, library
from kernels.write_kv import cache_strides

# The dtypes the Triton kernels take (kernels/triton/paged_attention.py).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PagedShapes(NamedTuple):
    """The sizes of a paged attention call's inputs."""

    num_tokens: int
    num_q_heads: int
    head_dim: int
    block_size: int
    num_kv_heads: int
    num_seqs: int
    group: int  # query heads per kv head


def check_paged_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, PagedShapes]:
    """Assert the shapes and layouts the paged attention kernels take; returns out (allocated
    like query when None) and the inputs' sizes."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = key_cache.shape
    assert kv_head_dim == head_dim, f"query head_dim {head_dim} != cache head_dim {kv_head_dim}"
    assert value_cache.shape == key_cache.shape, "value_cache must have key_cache's shape"
    # The Triton kernels pad other sizes to a power of two (config/attention.py's triton entry).
    assert head_dim % 8 == 0 and 16 <= head_dim <= 256, (
        f"head_dim must be a multiple of 8 from 16 to 256, got {head_dim}"
    )
    assert block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two, got {block_size}"
    )
    assert num_q_heads % num_kv_heads == 0, (
        f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}"
    )
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1, (
        "query_start_loc must have num_seqs + 1 entries"
    )
    assert query.dtype in DTYPES, f"unsupported dtype {query.dtype}"
    for t in (query, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1, (
        "out must be [T, Hq, D] with contiguous head_dim"
    )
    return out, PagedShapes(
        num_tokens,
        num_q_heads,
        head_dim,
        block_size,
        num_kv_heads,
        seq_lens.shape[0],
        num_q_heads // num_kv_heads,
    )


def paged_strides(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[int, ...]:
    """The paged kernels' stride arguments for the caches and the block table, in their order
    (stride_kb ... stride_vh, stride_bt)."""
    return (*cache_strides(key_cache, value_cache), block_table.stride(0))


def check_features(
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    num_q_heads: int,
    logits_soft_cap: float | None = None,
) -> None:
    """Assert a sliding window of at least one position, sinks of one value per query head and
    a positive soft cap."""
    assert sliding_window is None or sliding_window >= 1, (
        f"sliding_window must be at least 1, got {sliding_window}"
    )
    assert sinks is None or (sinks.shape == (num_q_heads,) and sinks.is_contiguous()), (
        f"sinks must be a contiguous [{num_q_heads}], got {tuple(sinks.shape)}"
    )
    assert logits_soft_cap is None or logits_soft_cap > 0, (
        f"logits_soft_cap must be positive, got {logits_soft_cap}"
    )


def paged_attention_cpu(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal GQA attention of packed queries q [T, Hq, D] over the paged caches, reading blocks
    in place; returns [T, Hq, D]. Caches in the CPU layout: key_cache [num_blocks, Hkv, D,
    block_size] (each block's keys transposed), value_cache [num_blocks, Hkv, block_size, D];
    block_size a multiple of 16, D 64 or 128; fp32, or both float8_e4m3fn (an fp8 cache, read
    as key * k_scale and value * v_scale). sliding_window, sinks ([Hq] fp32) and
    logits_soft_cap as in paged_attention_ref; blocks wholly before a query tile's window are
    not read."""
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    check_cpu(q, "q")
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        check_cpu(t, name, torch.float8_e4m3fn if fp8 else torch.float32)
    for t, name in (
        (block_table, "block_table"),
        (query_start_loc, "query_start_loc"),
        (seq_lens, "seq_lens"),
    ):
        check_cpu(t, name, torch.int32)
    check_rows(q, "q")
    if not (
        key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and block_table.stride(1) == 1
        and query_start_loc.is_contiguous()
        and seq_lens.is_contiguous()
    ):
        raise ValueError(
            "caches, block_table rows, query_start_loc and seq_lens must be contiguous"
        )
    tokens, q_heads, head_dim = q.shape
    num_blocks, kv_heads, cache_dim, block_size = key_cache.shape
    if (
        cache_dim != head_dim
        or q_heads % kv_heads
        or value_cache.shape != (num_blocks, kv_heads, block_size, head_dim)
    ):
        raise ValueError(
            f"q {tuple(q.shape)} does not match caches {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if sinks is not None:
        check_cpu(sinks, "sinks")
        if sinks.shape != (q_heads,) or not sinks.is_contiguous():
            raise ValueError(f"sinks {tuple(sinks.shape)} must be a packed [{q_heads}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    if out is None:
        out = torch.empty(tokens, q_heads, head_dim)
    check_rows(out, "out")
    num_reqs = seq_lens.shape[0]
    if num_reqs and tokens:
        rc = library().paged_attention_f32(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            out.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            num_reqs,
            q_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            None if sinks is None else sinks.data_ptr(),
            logits_soft_cap or 0.0,
            int(fp8),
            k_scale,
            v_scale,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError(
                f"the CPU paged attention kernel takes head_dim 64 or 128 and a "
                f"block_size that is a multiple of 16, not {head_dim} and {block_size}"
            )
        if rc != 0:
            raise MemoryError("paged_attention_f32 could not allocate its scratch memory")
    return out


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each request's packed queries over its paged K/V, computed in fp32;
    the result is on query's device, in out_dtype (default: query's dtype). sliding_window: a
    query at position p sees keys p - sliding_window + 1 .. p only; sinks [Hq]: a logit per query
    head joining each softmax's denominator and attending to nothing (transformers' gpt-oss);
    logits_soft_cap c: each scaled score s becomes c * tanh(s / c) before the mask and the
    softmax (transformers' Gemma 2 eager attention)."""
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
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        allowed = positions[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= positions[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().to(device)[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
