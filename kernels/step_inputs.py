"""The outputs of a step's input preparation (kernels/prepare_inputs.py, and its Triton
launcher in kernels/triton/prepare_inputs.py): PreparedInputs, their allocation for a step's
sizes and the check that a caller's reused set fits the step (each kernel writes them through
raw pointers).
"""

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


def outputs_fit(
    out: PreparedInputs,
    device: torch.device,
    num_reqs: int,
    num_tokens: int,
    max_blocks: int,
    num_samples: int,
) -> bool:
    """Whether out is what empty_outputs makes for this step: contiguous tensors on device of
    the contract's shapes and dtypes (a kernel writes them through raw pointers)."""
    i64, i32 = torch.int64, torch.int32
    ids, pos, lens, mapping, table, logits, sample = out
    return (
        ids.shape == (num_tokens,)
        and pos.shape == (num_tokens,)
        and mapping.shape == (num_tokens,)
        and lens.shape == (num_reqs,)
        and table.shape == (num_reqs, max_blocks)
        and logits.shape == (num_samples,)
        and sample.shape == (num_samples,)
        and ids.dtype is i64
        and pos.dtype is i64
        and mapping.dtype is i64
        and lens.dtype is i32
        and table.dtype is i32
        and logits.dtype is i64
        and sample.dtype is i64
        and all(t.device == device and t.is_contiguous() for t in out)
    )


# The outputs the last check_outputs passed and their step's sizes: a caller reusing one set
# step after step (InputPreparer) is checked once per shape. A tensor's dtype, device and
# layout do not change in place (short of resize_/set_, which no caller does to these).
_checked: list = [None, None]


def check_outputs(
    out: PreparedInputs,
    device: torch.device,
    num_reqs: int,
    num_tokens: int,
    max_blocks: int,
    num_samples: int,
) -> None:
    """Raise ValueError unless outputs_fit."""
    sizes = (num_reqs, num_tokens, max_blocks, num_samples)
    if _checked[0] is out and _checked[1] == sizes:
        return
    if not outputs_fit(out, device, num_reqs, num_tokens, max_blocks, num_samples):
        want = empty_outputs(device, num_reqs, num_tokens, max_blocks, num_samples)
        raise ValueError(
            "out does not match the step: want "
            + ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in zip(want._fields, want))
            + " (contiguous, on "
            + str(device)
            + "), got "
            + ", ".join(f"{tuple(t.shape)} {t.dtype} {t.device}" for t in out)
        )
    _checked[0], _checked[1] = out, sizes
