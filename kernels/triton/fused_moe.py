"""fused_experts_triton, the mixture of experts on CUDA (kernels/fused_moe.py says what it
computes): moe_align sorts the (token, k) pairs by expert into blocks on the device, then two
grouped GEMMs over those blocks. Imported only where it runs: fused_experts on CUDA, and the
tests under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_activation import ACTIVATION_CODES, ACTIVATIONS

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The fixed bound on the rows moe_align lays out: every pair, plus at most block_m - 1
    padding rows for each expert that has a pair (at most min(E, pairs) of them), rounded up
    to whole blocks. It depends on shapes only, so a captured graph replays with it."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of topk_ids [T, k] grouped by local expert into blocks of block_m
    rows, on the device and without host syncs: (sorted_pairs [P], block_experts [P / block_m])
    with P = padded_capacity(T * k, num_experts, block_m). sorted_pairs holds pair indices
    t * k + j, each expert's pairs in their original order from the start of its first block, the
    padding rows T * k; block_experts the local expert of each block, -1 for the unused blocks
    at the end. Pairs whose expert expert_map sends to -1 (another rank's) are left out."""
    flat = topk_ids.reshape(-1)
    if expert_map is not None:
        flat = expert_map[flat]
    num_pairs, device = flat.numel(), flat.device
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    # Other ranks' pairs go to one extra bucket, num_experts, which gets no rows.
    bucket = torch.where(flat < 0, num_experts, flat).to(torch.int64)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # Row where each bucket's pairs start; the extra bucket's all land on one discarded slot.
    starts = torch.cat([ends - padded, torch.full((1,), capacity, device=device)])
    order = bucket.argsort(stable=True)
    sorted_bucket = bucket[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    dest = torch.where(sorted_bucket == num_experts, capacity, starts[sorted_bucket] + rank)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs[:capacity], block_experts


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    HIDDEN,
    INTER,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    swiglu_limit,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[pair, n] = act(gate, up) for one block of pairs and BLOCK_N of the I outputs: the gate
    and up columns of the same outputs in one program, so the activation runs in registers."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + ks[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_mask = ks < HIDDEN - k0
        w_mask = k_mask[:, None] & col_mask[None, :]
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + cols
        gate += tl.load(b_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptrs + INTER, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:
        h = gate / (1.0 + tl.exp(-gate)) * up
    else:
        if HAS_LIMIT:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        h = (up + 1.0) * (gate / (1.0 + tl.exp(-1.702 * gate)))
    h_ptrs = h_ptr + pairs[:, None] * stride_hm + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    topk_weights_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    HIDDEN,
    INTER,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[pair, n] = router weight * (h[pair] @ w2[e]^T + b2[e])[n] for one block of pairs and
    BLOCK_N of the H outputs, in fp32."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None] * stride_hm + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_mask = ks < INTER - k0
        a = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_be + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    scale = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts average few pairs (decode), more once
    each block's weight tile serves enough rows to be worth the padding (about where vLLM's
    tuned H100 tables for Qwen3-30B-A3B's experts move up)."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 8 else 32 if per_expert <= 24 else 64


def _tiles(
    device: torch.device, n: int, k: int, block_m: int, tokens: int, gate_up: bool
) -> tuple[int, int, dict[str, int]]:
    """(BLOCK_N, BLOCK_K, launch options) for an [n outputs, k inputs] GEMM; gate_up: kernel 1,
    whose programs hold BLOCK_N gate and BLOCK_N up columns."""
    if device.type == "cuda":
        # Narrow column tiles at a few tokens, so a decode step's few experts still spread over
        # every SM (8 experts x 768 / 32 = 192 programs), wider ones once every expert has rows.
        # After vLLM's tuned H100 configurations for 128 experts of 768; not tuned here.
        if tokens <= 2:
            block_n, block_k, stages = 32, 64, 4
        elif tokens <= 48:
            block_n, block_k, stages = 64, 128, 3
        else:
            block_n, block_k, stages = 128, 128 if block_m == 16 else 64, 3
        if gate_up:
            block_n = max(16, block_n // 2)
        return block_n, block_k, {"num_warps": 4, "num_stages": stages}
    # The interpreter's cost is per program and per op: whole small matrices in one tile, but
    # under 2**18 elements a dot (numpy's threaded GEMM on small operands is very slow).
    block_n = min(triton.next_power_of_2(n), 128)
    block_k = min(triton.next_power_of_2(k), max(16, 2**17 // (block_m * block_n)))
    return block_n, block_k, {}


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """fused_experts_torch's result by the Triton kernels (CUDA, or the CPU under
    TRITON_INTERPRET=1): [T, H] in x's dtype, products accumulated in fp32, the activation
    output h rounded to x's dtype. block_m (a power of two >= 16) overrides the heuristic."""
    if activation not in ACTIVATION_CODES:
        raise ValueError(
            f"MoE activation {activation!r} is not supported: {', '.join(ACTIVATIONS)}"
        )
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert x.dtype in _TL_DTYPES, f"x dtype {x.dtype} is not one of {tuple(_TL_DTYPES)}"
    expected = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)
    assert (w13.shape, w2.shape) == expected, (
        f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not match hidden size {hidden}"
    )
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, (
        "x, w13 and w2 need a contiguous last dim"
    )
    if tokens == 0:
        return torch.zeros_like(x)
    num_pairs = tokens * top_k
    block_m = block_m or _block_m(num_pairs, num_experts)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, block_m, expert_map)
    blocks = block_experts.numel()
    dot_dtype = _TL_DTYPES[x.dtype] if x.device.type == "cuda" else tl.float32
    # fp32 operands would otherwise be rounded to tf32 on tensor cores.
    precision = "ieee" if dot_dtype == tl.float32 else None
    weights = topk_weights.reshape(-1).contiguous()

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, options = _tiles(x.device, inter, hidden, block_m, tokens, True)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        w13 if b13 is None else b13,
        h,
        sorted_pairs,
        block_experts,
        num_pairs,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        0 if b13 is None else b13.stride(0),
        h.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit),
        TOP_K=top_k,
        HAS_BIAS=b13 is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        HAS_LIMIT=swiglu_limit is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        **options,
    )
    # Another rank's pairs get no block: their rows must read zero in the sum.
    make = torch.empty if expert_map is None else torch.zeros
    per_pair = make(num_pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, block_k, options = _tiles(x.device, hidden, inter, block_m, tokens, False)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h,
        w2,
        w2 if b2 is None else b2,
        weights,
        per_pair,
        sorted_pairs,
        block_experts,
        num_pairs,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        0 if b2 is None else b2.stride(0),
        per_pair.stride(0),
        HAS_BIAS=b2 is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        **options,
    )
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
