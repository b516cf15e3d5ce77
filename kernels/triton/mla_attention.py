"""mla_attention, the Triton kernel of multi-head latent attention over a paged latent cache
(kernels/mla_attention.py says what it computes and holds the torch reference), and write_latent,
the cache write by slot mapping. Imported only where they run: the MLA Triton backend on CUDA,
and the tests under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.paged_attention import TL_DTYPES, dot_types, find_request


# num_seqs and the block table's row stride change every step: not specialised on.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _mla_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    seq = find_request(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_q0 = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row r is query token tile_q0 + r // BLOCK_H, head program_id(1) * BLOCK_H + r % BLOCK_H.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = tile_q0 + offs_m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    row_valid = (tok < q_len) & (head < num_heads)
    q_pos = ctx_len + tok
    offs_r = tl.arange(0, LATENT_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    r_valid = offs_r < LATENT
    p_valid = offs_p < ROPE

    q_row = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_lat = tl.load(
        q_ptr + q_row[:, None] + offs_r[None, :],
        mask=row_valid[:, None] & r_valid[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_ptr + q_row[:, None] + LATENT + offs_p[None, :],
        mask=row_valid[:, None] & p_valid[None, :],
        other=0.0,
    )
    q_lat = q_lat.to(tl.float32).to(DOT_DTYPE)
    q_pe = q_pe.to(tl.float32).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, LATENT_PAD], dtype=tl.float32)
    # Every row allows key 0 (q_pos >= 0), so the running max is finite after the first tile.
    kv_end = tl.minimum(ctx_len + tile_q0 + BLOCK_Q, seq_len)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        k_off = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        latent = tl.load(
            cache_ptr + k_off[:, None] + offs_r[None, :],
            mask=k_valid[:, None] & r_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, LATENT_PAD]: the keys' latent part and the values
        k_pe = tl.load(
            cache_ptr + k_off[None, :] + LATENT + offs_p[:, None],
            mask=p_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [ROPE_PAD, BLOCK_N]
        latent = latent.to(tl.float32).to(DOT_DTYPE)
        k_pe = k_pe.to(tl.float32).to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, k_pe, input_precision=DOT_PRECISION)
        s = s * scale_log2
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), latent, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_row[:, None] + offs_r[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & r_valid[None, :],
    )


@triton.jit
def _write_latent_kernel(
    cache_ptr, latent_ptr, slot_ptr, stride_lt, DIM: tl.constexpr, DIM_PAD: tl.constexpr
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padded row (CUDA graph buffers): nothing to write
    offs = tl.arange(0, DIM_PAD)
    row = tl.load(latent_ptr + token * stride_lt + offs, mask=offs < DIM)
    tl.store(cache_ptr + slot * DIM + offs, row, mask=offs < DIM)


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, D] (contiguous) at slot s <- latent [T, D] row t where
    slot_mapping[t] = s; a slot of -1 writes nothing."""
    assert cache.is_contiguous() and latent.stride(-1) == 1
    assert latent.shape[-1] == cache.shape[-1] and latent.dtype == cache.dtype
    if latent.shape[0] == 0:
        return
    dim = cache.shape[-1]
    _write_latent_kernel[(latent.shape[0],)](
        cache, latent, slot_mapping, latent.stride(0), DIM=dim, DIM_PAD=triton.next_power_of_2(dim)
    )


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's packed queries q [T, H, latent_dim + rope_dim] over
    its cached vectors (cache [num_blocks, block_size, latent_dim + rope_dim]), values their
    first latent_dim elements: [T, H, latent_dim]. Matches mla_attention_ref. max_query_len, a
    host value, picks shorter tiles for decode-only steps."""
    num_tokens, num_heads, dim = q.shape
    num_blocks, block_size, cache_dim = cache.shape
    assert cache_dim == dim and latent_dim < dim, f"q [.., {dim}] vs cache [.., {cache_dim}]"
    assert q.stride(-1) == 1 and cache.stride(-1) == 1 and q.dtype in TL_DTYPES
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1
    out = q.new_empty(num_tokens, num_heads, latent_dim)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    block_h = min(16, max(1, triton.next_power_of_2(num_heads)))
    # 16 rows (tl.dot's least) for decodes; 32 for prefill, whose [32, 512] fp32 accumulator is
    # 64 registers a thread at 8 warps.
    decode = max_query_len == 1
    rows = 16 if decode else 32
    block_q = max(1, rows // block_h)
    if max_query_len is not None:
        block_q = max(max(1, 16 // block_h), min(block_q, triton.next_power_of_2(max_query_len)))
    block_n = max(16, min(64, 16384 // latent_pad))
    dot_dtype, dot_precision = dot_types(q)
    grid = (num_tokens // block_q + num_seqs, triton.cdiv(num_heads, block_h))
    _mla_attention_kernel[grid](
        out,
        q,
        cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),
        num_seqs,
        num_heads,
        *q.stride()[:2],
        *out.stride()[:2],
        *cache.stride()[:2],
        block_table.stride(0),
        LATENT=latent_dim,
        ROPE=dim - latent_dim,
        LATENT_PAD=latent_pad,
        ROPE_PAD=max(16, triton.next_power_of_2(dim - latent_dim)),
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=4 if decode else 8,
    )
    return out
