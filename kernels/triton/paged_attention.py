"""paged_attention, the Triton flash-attention kernel over a paged KV cache ([num_blocks,
block_size, Hkv, D]) for mixed prefill/decode batches, and the pieces the other Triton attention
kernels share (find_request, attend_tile, dot_types, head_pad). kernels/paged_attention.py holds
the input checks, the C kernel and the torch reference. Imported only where a Triton kernel runs:
the Triton attention backends on CUDA, and the tests under TRITON_INTERPRET=1.

Head sizes that are not powers of two (Phi-3-mini's 96) run padded, as vLLM's Triton attention
does: the head-dimension tiles span head_pad(head_dim) lanes and every load and store masks the
lanes past head_dim, so the caches and the output keep their unpadded [.., head_dim] layout.

An fp8 cache (float8_e4m3fn, --kv-cache-dtype fp8) is read through the same loads: each tile
converts exactly to fp32 (then to the dot's dtype, which holds every e4m3 value), and the
layer's scales fold into the fp32 arithmetic: k_scale into the scores' scale, v_scale into the
output's normalisation (host floats: constants in a captured graph, no device read).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.paged_attention import check_features, check_paged_inputs, paged_strides

# Rows (query tokens x query heads of one kv group) per tile: tl.dot needs at least 16.
_MIN_ROWS = 16
_TARGET_ROWS = 64
_MIN_BLOCK_N = 64
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def find_request(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    # Request i owns tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), a monotonic
    # layout that covers ceil(q_len / BLOCK_Q) tiles per request without a host-side sync.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    k_pos,
    k_valid,
    allowed,
    kv_head,
    offs_d,
    d_valid,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr = False,
    SOFT_CAP: tl.constexpr = 0.0,
):
    """One key tile of the online softmax, shared by the one-pass and the split-decode kernels:
    keys and values at positions k_pos (k_valid: to be read) of the request whose block-table
    row starts at bt_row, read through the table for kv_head; scores where `allowed` is false
    count as -inf. MAY_BE_EMPTY: a row may have seen no allowed key yet (a sliding window), so
    its running max may still be -inf. SOFT_CAP c > 0: each scaled score s becomes
    c * tanh(s / c) (Gemma 2). offs_d spans the padded head size; d_valid marks its real lanes
    (the padding reads zeros, which add nothing to q.k and fill output lanes never stored).
    Returns the updated running max, sum and un-normalised output."""
    block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    in_block = k_pos % BLOCK_SIZE
    k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
    k_mask = k_valid[None, :] & d_valid[:, None]
    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
    k = k.to(tl.float32).to(DOT_DTYPE)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if SOFT_CAP > 0:
        # The scores are in log2 units (s * log2(e)): c * tanh(s / c) there is the same with
        # c * log2(e) as the cap.
        s = soft_cap(s, SOFT_CAP * LOG2E)
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = m_new
    if MAY_BE_EMPTY:
        # -inf - -inf is NaN: a row with no key yet subtracts 0 (its terms are all 0).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_mask = k_valid[:, None] & d_valid[None, :]
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
    v = v.to(tl.float32).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), elementwise, with tanh from one exp2 of a non-positive argument
    (no overflow at any score)."""
    x = tl.abs(s) / cap
    e = tl.exp2(x * (-2.0 * LOG2E))  # exp(-2|x|) in (0, 1]
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def _initial_max_sum(sinks_ptr, q_head, row_valid, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's starting running max and sum (log2 units): -inf and 0, or with sinks
    the row's sink as if it were a first key with a zero value (max sink, sum 1)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E
        m_i = tl.where(row_valid, sink, float("-inf"))
        l_i = tl.where(row_valid, 1.0, 0.0)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    return m_i, l_i


# num_seqs and the block table's row stride (its width is the step's longest request) change every
# step: specialising on them (== 1, % 16) would compile a kernel per value class.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    v_scale=1.0,
    SCALE_OUT: tl.constexpr = False,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_request(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_q0 = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row r is query token tile_q0 + r // GROUP_PAD, head r % GROUP_PAD within the kv group.
    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = tile_q0 + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    row_valid = (tok < q_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    q_pos = ctx_len + tok
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_DIM
    row_d = row_valid[:, None] & d_valid[None, :]

    q_row = (q_start + tok).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=row_d, other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    m_i, l_i = _initial_max_sum(sinks_ptr, q_head, row_valid, BLOCK_Q * GROUP_PAD, HAS_SINKS)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    # Without a window every row keeps key 0 unmasked (q_pos >= 0 and kv_end >= 1), so m_i is
    # finite after the first chunk and the -inf initialisation never produces NaN; with one, a
    # row's keys may start in a later chunk than the tile's first row's (attend_tile guards).
    kv_end = tl.minimum(ctx_len + tile_q0 + BLOCK_Q, seq_len)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        # The tile's first query has the oldest window; keys before it are never loaded.
        kv_start = tl.maximum(ctx_len + tile_q0 - SLIDING_WINDOW + 1, 0)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start // BLOCK_SIZE * BLOCK_SIZE, kv_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        if SLIDING_WINDOW > 0:
            k_valid = k_valid & (k_pos >= kv_start)
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if SLIDING_WINDOW > 0:
            causal = causal & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            k_pos,
            k_valid,
            causal,
            kv_head,
            offs_d,
            d_valid,
            scale_log2,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            BLOCK_SIZE,
            DOT_DTYPE,
            DOT_PRECISION,
            SLIDING_WINDOW > 0,
            SOFT_CAP,
        )

    if SLIDING_WINDOW > 0:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows may have seen no key at all
    acc = acc / l_i[:, None]
    if SCALE_OUT:
        acc = acc * v_scale
    o_row = (q_start + tok).to(tl.int64) * stride_ot + q_head * stride_oh
    tl.store(
        out_ptr + o_row[:, None] + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_d,
    )


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def head_pad(head_dim: int) -> int:
    """The lanes the kernels' head-dimension tiles span for head_dim: the next power of two
    (tl.arange and tl.dot need one), at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_types(query: torch.Tensor) -> tuple[tl.dtype, str | None]:
    """The operand dtype and precision of the kernels' tl.dot for query's dtype and device."""
    # CPU tensors only run under the interpreter, whose tl.dot is wrong for 16-bit operands.
    dot_dtype = TL_DTYPES[query.dtype] if query.device.type == "cuda" else tl.float32
    # fp32 operands would otherwise be rounded to tf32 on tensor cores.
    return dot_dtype, "ieee" if dot_dtype == tl.float32 else None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal GQA attention of each request's packed queries over its paged K/V; matches
    paged_attention_ref, sliding_window, sinks ([Hq], on query's device) and logits_soft_cap
    included. With a window, each query tile's walk starts at its first query's window: earlier
    blocks are not read. An fp8 cache (float8_e4m3fn) is read as key * k_scale and
    value * v_scale."""
    out, shapes = check_paged_inputs(query, key_cache, value_cache, query_start_loc, seq_lens, out)
    check_features(sliding_window, sinks, shapes.num_q_heads, logits_soft_cap)
    if shapes.num_tokens == 0 or shapes.num_seqs == 0:
        return out

    group_pad = triton.next_power_of_2(shapes.group)
    min_block_q = max(1, _MIN_ROWS // group_pad)
    block_q = max(min_block_q, _TARGET_ROWS // group_pad)
    if max_query_len is not None:
        # Decode-heavy batches waste fewer rows with short tiles.
        block_q = max(min_block_q, min(block_q, triton.next_power_of_2(max_query_len)))
    block_n = max(shapes.block_size, _MIN_BLOCK_N)
    dot_dtype, dot_precision = dot_types(query)

    num_tiles = shapes.num_tokens // block_q + shapes.num_seqs
    _paged_attention_kernel[(num_tiles, shapes.num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        out if sinks is None else sinks,  # any pointer when there are none (never read)
        scale * k_scale * math.log2(math.e),
        shapes.num_seqs,
        *query.stride()[:2],
        *out.stride()[:2],
        *paged_strides(key_cache, value_cache, block_table),
        GROUP=shapes.group,
        GROUP_PAD=group_pad,
        HEAD_DIM=shapes.head_dim,
        HEAD_PAD=head_pad(shapes.head_dim),
        BLOCK_SIZE=shapes.block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SLIDING_WINDOW=sliding_window or 0,
        HAS_SINKS=sinks is not None,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        v_scale=float(v_scale),
        SCALE_OUT=v_scale != 1.0,
        num_warps=4,
    )
    return out
