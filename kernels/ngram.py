"""The n-gram proposer's matching over the model runner's token table (vLLM's prompt lookup).

For request i (row slots[i] of token_ids, num_tokens[i] tokens known): the longest n in
[min_n, max_n] such that the row's last n tokens occur earlier in it (an occurrence may overlap
them, but at least one token must follow it), at that n-gram's earliest occurrence; the drafts
out[i] are the tokens that followed it, at most limits[i] and as many as the row holds, then -1.
vLLM's ngram_proposer.py picks the same occurrence (its KMP keeps the earliest of the longest).

One contract, three implementations side by side: torch ops (the reference, and the path on a
device with neither), Triton (CUDA, kernels/triton/ngram.py: nothing read back to the host) and
C (kernels/cpu/ngram.c); ngram_propose_for() picks one for a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu_binding import check_cpu, library
from kernels.dispatch import kernel_for

# (token_ids [R, W], slots [S], num_tokens [S], limits [S], min_n, max_n, out [S, K]) -> None
NgramProposeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.Tensor], None
]


def ngram_propose_torch(
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    limits: torch.Tensor,
    min_n: int,
    max_n: int,
    out: torch.Tensor,
) -> None:
    """The reference in torch ops: every end position's match length at once ([S, W] each)."""
    num_reqs, k = out.shape
    if not num_reqs:
        return
    # On the CPU only the known columns (reading num_tokens is free there); a device's whole row.
    width = int(num_tokens.max()) if token_ids.device.type == "cpu" else token_ids.shape[1]
    rows = token_ids.index_select(0, slots)[:, : max(width, 1)]  # [S, W]
    ends = torch.arange(rows.shape[1], device=rows.device)  # candidate ends of an occurrence
    last = (num_tokens - 1).unsqueeze(1)  # [S, 1]
    run = ends.unsqueeze(0) < last  # at least one token follows the occurrence
    lengths = torch.zeros_like(rows)
    for j in range(max_n):
        shifted = torch.roll(rows, j, dims=1)  # shifted[:, e] = rows[:, e - j] for e >= j
        suffix = rows.gather(1, (last - j).clamp(min=0))
        run = run & (ends >= j) & (shifted == suffix)
        lengths += run
    best = lengths.max(dim=1).values  # [S]
    # argmax gives the first of equal maxima: the earliest occurrence of the longest n-gram.
    first = (lengths == best.unsqueeze(1)).to(torch.uint8).argmax(dim=1) + 1
    count = torch.minimum(limits.clamp(min=0, max=k), num_tokens - first)
    count = torch.where(best >= min_n, count, 0)
    cols = torch.arange(k, device=rows.device)
    at = (first.unsqueeze(1) + cols).clamp(max=rows.shape[1] - 1)
    drafts = rows.gather(1, at)
    out.copy_(torch.where(cols < count.unsqueeze(1), drafts, -1))


def ngram_propose_cpu(
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    limits: torch.Tensor,
    min_n: int,
    max_n: int,
    out: torch.Tensor,
) -> None:
    """The contract in one C call (kernels/cpu/ngram.c)."""
    tensors = (
        (token_ids, "token_ids"),
        (slots, "slots"),
        (num_tokens, "num_tokens"),
        (limits, "limits"),
        (out, "out"),
    )
    # Once per step: the whole check in one expression, the messages only when it fails.
    if not all(t.dtype is torch.int64 and t.is_cpu for t, _ in tensors):
        for t, name in tensors:
            check_cpu(t, name, torch.int64)
    num_reqs = slots.shape[0]
    if token_ids.dim() != 2 or token_ids.stride(1) != 1:
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must be 2-D with packed columns")
    if not all(t.is_contiguous() for t, _ in tensors[1:]):
        raise ValueError("ngram_propose needs contiguous slots, num_tokens, limits and out")
    if num_tokens.shape != (num_reqs,) or limits.shape != (num_reqs,) or out.shape[0] != num_reqs:
        raise ValueError(
            f"num_tokens {tuple(num_tokens.shape)} / limits {tuple(limits.shape)} / out "
            f"{tuple(out.shape)} do not match slots {tuple(slots.shape)}"
        )
    if num_reqs:
        library().ngram_propose_i64(
            token_ids.data_ptr(),
            token_ids.stride(0),
            slots.data_ptr(),
            num_tokens.data_ptr(),
            limits.data_ptr(),
            num_reqs,
            min_n,
            max_n,
            out.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )


def _triton() -> NgramProposeFn:
    """The Triton launcher, imported only when a CUDA device asks for it."""
    from kernels.triton.ngram import ngram_propose_triton

    return ngram_propose_triton


def ngram_propose_for(device: torch.device) -> NgramProposeFn:
    """The implementation for a device: Triton on CUDA, C on a CPU where the kernels are built,
    torch ops otherwise. Each takes (token_ids, slots, num_tokens, limits, min_n, max_n, out)
    and writes the drafts into out [S, K] (int64, -1 padded)."""
    cpu_impl: NgramProposeFn = ngram_propose_cpu
    return kernel_for(device, _triton, cpu_impl, ngram_propose_torch)
