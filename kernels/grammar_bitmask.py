"""Masking logits with a grammar's token bitmask: a C kernel on CPU, torch ops elsewhere.

bitmask[i] is an int32 row of ceil(V / 32) words for logits row rows[i]; bit b of word w allows
token 32 * w + b (xgrammar's layout). Forbidden tokens become -inf, in place.
"""

from __future__ import annotations

import torch

from kernels.cpu_library import load


def _kernel():
    lib = load()
    if lib is None:
        return None
    return lib.apply_token_bitmask_f32


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


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The torch version: unpack the bits and fill the forbidden logits with -inf."""
    _check(logits, bitmask, rows)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    allowed = allowed[:, : logits.shape[1]].bool()
    picked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, picked)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Forbid, in place, the tokens each row's bitmask leaves out (logits [N, V], bitmask
    [R, ceil(V/32)] int32, rows [R] int64, all on the logits' device)."""
    _check(logits, bitmask, rows)
    fn = _kernel() if logits.is_cpu and logits.dtype == torch.float32 else None
    if fn is None or logits.stride(1) != 1 or not bitmask.is_contiguous():
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    rows = rows.contiguous()
    fn(
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.stride(0),
        rows.data_ptr(),
        rows.shape[0],
        logits.shape[1],
        torch.get_num_threads(),
    )
