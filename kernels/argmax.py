"""Greedy sampling's argmax over fp32 logits rows on the CPU (kernels/cpu/argmax.c). C only:
elsewhere the sampler runs torch.argmax.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, library


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] fp32 (rows any stride, columns packed) -> [N] int64, the first index of each
    row's maximum: torch.argmax(x, -1) for rows without NaN (a NaN row gives some index)."""
    check_cpu(x, "x")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x {tuple(x.shape)} must be 2-D with packed columns")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and x.shape[1]:
        library().argmax_rows_f32(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
    elif x.shape[0]:
        raise ValueError("argmax of an empty row")
    return out
