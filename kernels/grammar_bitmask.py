"""Masking logits with a grammar's token bitmask: a C kernel on CPU, torch ops elsewhere.

bitmask[i] is an int32 row of ceil(V / 32) words for logits row rows[i]; bit b of word w allows
token 32 * w + b (xgrammar's layout). Forbidden tokens become -inf, in place.
"""

from __future__ import annotations

import torch

from kernels import cpu_binding


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.dim() != 1:
        raise ValueError("logits and bitmask must be 2-D and rows 1-D")
    if bitmask.dtype != torch.int32 or rows.dtype != torch.int64:
        raise ValueError(f"bitmask must be int32 and rows int64, got {bitmask.dtype}, {rows.dtype}")
    if bitmask.shape[0] != rows.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask of shape {tuple(bitmask.shape)} does not cover "
            f"{rows.shape[0]} rows of {logits.shape[1]} logits"
        )


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The torch version, on any device: unpack the bits and fill the forbidden logits with
    -inf."""
    _check(logits, bitmask, rows)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    allowed = allowed[:, : logits.shape[1]].bool()
    picked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, picked)


def apply_token_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The C kernel (kernels/cpu/grammar_bitmask.c): fp32 CPU logits whose rows are packed, a
    packed bitmask; ValueError for any other layout."""
    _check(logits, bitmask, rows)
    cpu_binding.check_cpu(logits, "logits")
    if logits.stride(1) != 1 or not bitmask.is_contiguous():
        raise ValueError("logits rows and the bitmask must be packed")
    rows = rows.contiguous()
    cpu_binding.library().apply_token_bitmask_f32(
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.stride(0),
        rows.data_ptr(),
        rows.shape[0],
        logits.shape[1],
        torch.get_num_threads(),
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Forbid, in place, the tokens each row's bitmask leaves out (logits [N, V], bitmask
    [R, ceil(V/32)] int32, rows [R] int64, all on the logits' device): the C kernel where it
    takes this layout, else torch ops."""
    if (
        cpu_binding.applies(logits)
        and logits.stride(1) == 1
        and bitmask.is_contiguous()
        and bitmask.is_cpu
    ):
        apply_token_bitmask_cpu(logits, bitmask, rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)
