"""What a step's input preparation produces (kernels/prepare_inputs.py), shared by its three
implementations: torch ops there, the Triton kernel and the C twin (kernels/cpu_ops.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PreparedInputs(NamedTuple):
    """The gathered inputs of one step (T tokens, B requests, S sampling rows)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [S] int64: the token row each sampling row reads
    sample_slots: torch.Tensor  # [S] int64


def empty_outputs(
    device: torch.device, num_reqs: int, num_tokens: int, max_blocks: int, num_samples: int
) -> PreparedInputs:
    """Uninitialised output tensors for a kernel to fill."""

    def i64(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, device=device)

    return PreparedInputs(
        i64(num_tokens),
        i64(num_tokens),
        torch.empty(num_reqs, dtype=torch.int32, device=device),
        i64(num_tokens),
        torch.empty((num_reqs, max_blocks), dtype=torch.int32, device=device),
        i64(num_samples),
        i64(num_samples),
    )
