"""Split-context (flash-decoding) attention for decode-only steps over a paged KV cache.

A decode step with few sequences gives the one-pass kernel (kernels/triton/paged_attention.py) only
num_seqs * num_kv_heads programs, each walking its whole context: on a long context most of the
device sits idle. Here a first kernel runs one program per (sequence, kv head, partition of
partition_size tokens) and writes each partition's running max, sum and un-normalised output to fp32
scratch; a second kernel combines the partitions of each (sequence, query head) by log-sum-exp
rescaling, and counts a layer's sinks there, once.

With a sliding window the partitions start at the partition boundary at or before the window's
first key, so the grid covers the window, not the context, and nothing before it is read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.paged_attention import check_features, check_paged_inputs, paged_strides
from kernels.triton.paged_attention import LOG2E, attend_tile, dot_types, head_pad

# Tokens per partition on the device (vLLM's paged attention v2 uses 512 too).
PARTITION_SIZE = 512
# Query-head rows per program on the device: tl.dot needs at least 16, so small groups are padded.
_MIN_ROWS = 16
_MIN_BLOCK_N = 64
# The interpreter's cost is mostly per op, not per element: larger key tiles run tests faster.
_INTERPRETER_BLOCK_N = 1024
# Partitions the reduce kernel reads per loop step.
_PARTS_BLOCK = 32
# Below this context a decode step is short for every program anyway, and a second launch costs
# about what the split would save.
SPLIT_MIN_SEQ_LEN = 2048
# Programs per SM below which the one-pass kernel leaves the device under-filled.
_PROGRAMS_PER_SM = 2


def use_split_decode(
    max_query_len: int, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> bool:
    """Whether a step should run paged_decode_split rather than the one-pass kernel: decode-only
    (max_query_len == 1), a context of at least SPLIT_MIN_SEQ_LEN tokens, and fewer than
    _PROGRAMS_PER_SM programs per SM in the one-pass kernel's grid. Host values only."""
    return (
        max_query_len == 1
        and max_seq_len >= SPLIT_MIN_SEQ_LEN
        and num_seqs * num_kv_heads < _PROGRAMS_PER_SM * num_sms
    )


# Arguments whose values change from step to step: not specialising on them (== 1, % 16) keeps
# one compiled kernel for every step instead of one per value class.
@triton.jit
def _first_key(seq_len, SLIDING_WINDOW: tl.constexpr):
    """The first position the decode query (at seq_len - 1) sees through the window."""
    return tl.maximum(seq_len - SLIDING_WINDOW, 0)


@triton.jit(do_not_specialize=["stride_bt", "stride_ms", "stride_mh"])
def _decode_partition_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ms,
    stride_mh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    if SLIDING_WINDOW > 0:
        # Partitions count from the boundary at or before the window's first key.
        first = _first_key(seq_len, SLIDING_WINDOW)
        start += first // PARTITION * PARTITION
    # The grid covers the longest sequence (or window); shorter ones (and empty padding rows)
    # stop here.
    if (q_len == 0) | (start >= seq_len):
        return
    end = tl.minimum(start + PARTITION, seq_len)
    if SLIDING_WINDOW > 0:
        start = tl.maximum(start, first)  # the window's first partition starts inside it

    # Row r is query head kv_head * GROUP + r; rows >= GROUP are padding for tl.dot.
    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    q_head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_DIM
    row_d = row_valid[:, None] & d_valid[None, :]
    q_row = q_start.to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=row_d, other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
    # The decode query is the last position, so it sees every key before seq_len: no causal mask.
    # The first tile holds key `start` < end, so m_i is finite after it and no NaN appears.
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_valid = k_pos < end
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
            k_valid[None, :],
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
            False,
            SOFT_CAP,
        )

    # Scratch row (seq, q_head) holds one entry per partition; acc is the same layout with a
    # contiguous head_dim, so its offsets are multiples of HEAD_DIM the compiler can see.
    ml_off = seq.to(tl.int64) * stride_ms + q_head * stride_mh + part
    tl.store(m_ptr + ml_off, m_i, mask=row_valid)
    tl.store(l_ptr + ml_off, l_i, mask=row_valid)
    a_off = ml_off * HEAD_DIM
    tl.store(acc_ptr + a_off[:, None] + offs_d[None, :], acc, mask=row_d)


@triton.jit(do_not_specialize=["stride_ms", "stride_mh"])
def _decode_reduce_kernel(
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    stride_ms,
    stride_mh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    v_scale=1.0,
    SCALE_OUT: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    # Only this sequence's own partitions were written; seq_len >= 1 makes at least one.
    if SLIDING_WINDOW > 0:
        # Partitions count from the boundary at or before the window's first key.
        base = _first_key(seq_len, SLIDING_WINDOW) // PARTITION * PARTITION
        num_parts = (seq_len - base + PARTITION - 1) // PARTITION
    else:
        num_parts = (seq_len + PARTITION - 1) // PARTITION
    ml_base = seq.to(tl.int64) * stride_ms + head * stride_mh
    a_base = ml_base * HEAD_DIM  # acc is m's layout with a contiguous head_dim
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_DIM

    # Two passes over the (few) partition maxima keep every loop-carried value a vector.
    m_run = tl.full([PARTS_BLOCK], float("-inf"), dtype=tl.float32)
    for p0 in range(0, num_parts, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        m_part = tl.load(m_ptr + ml_base + offs_p, mask=offs_p < num_parts, other=float("-inf"))
        m_run = tl.maximum(m_run, m_part)
    m_all = tl.max(m_run, axis=0)
    if HAS_SINKS:
        # The sink is one more logit of the head's softmax, with a zero value vector.
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_all, sink)

    l_run = tl.zeros([PARTS_BLOCK], dtype=tl.float32)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for p0 in range(0, num_parts, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        valid = offs_p < num_parts
        m_part = tl.load(m_ptr + ml_base + offs_p, mask=valid, other=float("-inf"))
        l_part = tl.load(l_ptr + ml_base + offs_p, mask=valid, other=0.0)
        w = tl.exp2(m_part - m_all)  # 0 for masked partitions
        l_run += w * l_part
        a = tl.load(
            acc_ptr + a_base + offs_p[:, None] * HEAD_DIM + offs_d[None, :],
            mask=valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * a, axis=0)

    l_all = tl.sum(l_run, axis=0)
    if HAS_SINKS:
        l_all += tl.exp2(sink - m_all)
    out = acc / l_all
    if SCALE_OUT:
        out = out * v_scale  # an fp8 cache's value scale
    o_off = q_start.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def num_partitions(
    max_seq_len: int, partition_size: int = PARTITION_SIZE, sliding_window: int | None = None
) -> int:
    """Partitions of the longest sequence, or of a window's span (its first key's partition
    boundary to the end: at most sliding_window + partition_size - 1 keys): the split kernel's
    grid depth, from host values."""
    parts = max(1, -(-max_seq_len // partition_size))
    if sliding_window is not None:
        parts = min(parts, -(-(sliding_window + partition_size - 1) // partition_size))
    return parts


def paged_decode_split(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention (every request has 0 or 1 query token) of each request's query over its
    paged K/V, split along the context; matches paged_attention_ref for such batches. An fp8
    cache (float8_e4m3fn) is read as key * k_scale and value * v_scale.
    max_seq_len must be at least seq_lens.max() (a host value: nothing is read from the device);
    partition_size (default PARTITION_SIZE, or the block size if larger) must be a power of two
    and a multiple of the block size. sliding_window, sinks ([Hq]) and logits_soft_cap as in
    paged_attention_ref; with a window the partitions cover the window only."""
    out, shapes = check_paged_inputs(query, key_cache, value_cache, query_start_loc, seq_lens, out)
    num_tokens, num_q_heads, head_dim, block_size, num_kv_heads, num_seqs, group = shapes
    check_features(sliding_window, sinks, num_q_heads, logits_soft_cap)
    if partition_size is None:
        partition_size = max(PARTITION_SIZE, block_size)
    assert partition_size & (partition_size - 1) == 0 and partition_size >= block_size, (
        f"partition_size must be a power of two >= block_size {block_size}, got {partition_size}"
    )
    if num_tokens == 0 or num_seqs == 0:
        return out

    on_gpu = query.device.type == "cuda"
    rows = triton.next_power_of_2(group)
    if on_gpu:
        rows = max(_MIN_ROWS, rows)
        block_n = max(block_size, _MIN_BLOCK_N)
    else:
        # The interpreter's dot takes any shape; keeping rows * block_n * head_dim under
        # OpenBLAS's threading threshold (2**18) matters: numpy's threaded GEMM on small
        # operands is a thousand times slower on a busy machine.
        block_n = max(block_size, min(_INTERPRETER_BLOCK_N, 2**17 // (rows * head_pad(head_dim))))
    block_n = min(block_n, partition_size)  # both powers of two, so block_n divides a partition
    dot_dtype, dot_precision = dot_types(query)

    parts = num_partitions(max_seq_len, partition_size, sliding_window)
    m_scratch = torch.empty(num_seqs, num_q_heads, parts, dtype=torch.float32, device=query.device)
    l_scratch = torch.empty_like(m_scratch)
    acc = torch.empty(
        num_seqs, num_q_heads, parts, head_dim, dtype=torch.float32, device=query.device
    )
    _decode_partition_kernel[(num_seqs, num_kv_heads, parts)](
        m_scratch,
        l_scratch,
        acc,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale * k_scale * math.log2(math.e),
        *query.stride()[:2],
        *paged_strides(key_cache, value_cache, block_table),
        *m_scratch.stride()[:2],
        GROUP=group,
        ROWS=rows,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION=partition_size,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SLIDING_WINDOW=sliding_window or 0,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        num_warps=4,
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        out,
        m_scratch,
        l_scratch,
        acc,
        query_start_loc,
        seq_lens,
        out if sinks is None else sinks,  # any pointer when there are none (never read)
        *out.stride()[:2],
        *m_scratch.stride()[:2],
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad(head_dim),
        PARTITION=partition_size,
        PARTS_BLOCK=_PARTS_BLOCK,
        SLIDING_WINDOW=sliding_window or 0,
        HAS_SINKS=sinks is not None,
        v_scale=float(v_scale),
        SCALE_OUT=v_scale != 1.0,
        num_warps=4,
    )
    return out
