"""ngram_propose_triton, kernels/ngram.py's contract as one Triton launch of one program per
request: the program walks its row of the token table in blocks of candidate end positions,
each block's match lengths (up to MAX_N) at once, keeping the longest and earliest; it stops at
the first occurrence of a MAX_N-gram. Nothing is read back to the host. Imported only where it
runs: on CUDA (ngram_propose_for), and in the tests under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # candidate end positions per iteration


@triton.jit
def _ngram_kernel(
    token_ids_ptr,
    token_stride,
    slots_ptr,
    num_tokens_ptr,
    limits_ptr,
    out_ptr,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = token_ids_ptr + tl.load(slots_ptr + i) * token_stride
    total = tl.load(num_tokens_ptr + i).to(tl.int32)
    best = 0
    best_end = 0
    start = 0
    while (start < total - 1) & (best < MAX_N):
        ends = start + tl.arange(0, BLOCK)
        run = ends < total - 1  # at least one token follows the occurrence
        lengths = tl.zeros((BLOCK,), dtype=tl.int32)
        for j in tl.static_range(MAX_N):
            # The suffix's j-th token from the end; clamped where the row is shorter than j + 1
            # (then no end position reaches back j tokens either).
            suffix = tl.load(row + tl.maximum(total - 1 - j, 0))
            run = run & (ends >= j)
            token = tl.load(row + ends - j, mask=run, other=-1)
            run = run & (token == suffix)
            lengths += run.to(tl.int32)
        block_best = tl.max(lengths, axis=0)
        block_end = tl.min(tl.where(lengths == block_best, ends, total), axis=0)
        longer = block_best > best  # strictly: an earlier block's occurrence wins a tie
        best_end = tl.where(longer, block_end, best_end)
        best = tl.where(longer, block_best, best)
        start += BLOCK
    first = best_end + 1
    limit = tl.minimum(tl.load(limits_ptr + i), K).to(tl.int32)
    count = tl.where(best >= MIN_N, tl.minimum(limit, total - first), 0)
    cols = tl.arange(0, BLOCK_K)
    drafts = tl.load(row + first + cols, mask=cols < count, other=-1)
    tl.store(out_ptr + i * K + cols, drafts, mask=cols < K)


def ngram_propose_triton(
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    limits: torch.Tensor,
    min_n: int,
    max_n: int,
    out: torch.Tensor,
) -> None:
    """One launch of one program per request (out packed [S, K])."""
    num_reqs, k = out.shape
    if not out.is_contiguous() or token_ids.stride(1) != 1:
        raise ValueError("ngram_propose_triton needs a packed out and token_ids columns")
    if num_reqs:
        _ngram_kernel[(num_reqs,)](
            token_ids,
            token_ids.stride(0),
            slots,
            num_tokens,
            limits,
            out,
            MIN_N=min_n,
            MAX_N=max_n,
            K=k,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK=_BLOCK,
        )
