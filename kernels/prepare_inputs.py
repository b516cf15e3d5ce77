"""A step's model inputs gathered on the device from the runner's persistent request state.

Request i of a step computes tokens qsl[i]..qsl[i+1] of the packed batch, at positions
num_computed[slot] onward of its slot slots[i]. From those two small arrays (copied from the host
once per step) and the persistent tables, one kernel writes the input ids (a decode's is the
token the previous step's post-update wrote into token_ids), positions, sequence lengths, KV
slot mapping, the step's block-table rows, and for the rows that sample (sample_rows) their
logits row and slot. Three implementations with one contract, side by side: torch ops (the
reference, and the path without either), a Triton kernel (CUDA, kernels/triton/prepare_inputs.py)
and its C twin
(kernels/cpu/prepare_inputs.c); prepare_inputs_for() picks one for a device.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.cpu_binding import check_cpu, library
from kernels.dispatch import kernel_for
from kernels.step_inputs import PreparedInputs, check_outputs, empty_outputs


def prepare_inputs_torch(
    slots: torch.Tensor,
    qsl: torch.Tensor,
    sample_rows: torch.Tensor,
    num_computed: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_blocks: int,
    out: PreparedInputs | None = None,
) -> PreparedInputs:
    """The reference: a dozen torch ops, on any device (into out's tensors when given)."""
    qsl_long = qsl.to(torch.int64)
    iota = torch.arange(num_tokens, dtype=torch.int64, device=slots.device)
    token_req = torch.searchsorted(qsl_long[1:], iota, right=True)
    token_slot = slots.index_select(0, token_req)
    computed = num_computed.index_select(0, slots)
    seq_lens = (computed + (qsl_long[1:] - qsl_long[:-1])).to(torch.int32)
    positions = computed.index_select(0, token_req) + iota - qsl_long.index_select(0, token_req)
    input_ids = token_ids.reshape(-1).index_select(0, token_slot * token_ids.stride(0) + positions)
    block_index = token_slot * block_table.stride(0) + positions // block_size
    slot_mapping = (
        block_table.reshape(-1).index_select(0, block_index).to(torch.int64) * block_size
        + positions % block_size
    )
    result = PreparedInputs(
        input_ids,
        positions,
        seq_lens,
        slot_mapping,
        block_table[:, :max_blocks].index_select(0, slots),
        qsl_long.index_select(0, sample_rows + 1) - 1,
        slots.index_select(0, sample_rows),
    )
    if out is None:
        return result
    check_outputs(out, slots.device, slots.shape[0], num_tokens, max_blocks, sample_rows.shape[0])
    for dst, src in zip(out, result):
        dst.copy_(src)
    return out


def prepare_inputs_cpu(
    slots: torch.Tensor,
    qsl: torch.Tensor,
    sample_rows: torch.Tensor,
    num_computed: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_blocks: int,
    out: PreparedInputs | None = None,
) -> PreparedInputs:
    """kernels.prepare_inputs' contract in one C call (kernels/cpu/prepare_inputs.c); into
    out's tensors when given (checked: the C code writes them through raw pointers)."""
    i64, i32 = torch.int64, torch.int32
    # Once per step: the whole check in one expression, the messages only when it fails.
    if not (
        slots.dtype is i64
        and qsl.dtype is i32
        and sample_rows.dtype is i64
        and num_computed.dtype is i64
        and token_ids.dtype is i64
        and block_table.dtype is i32
        and slots.is_cpu
        and qsl.is_cpu
        and sample_rows.is_cpu
        and num_computed.is_cpu
        and token_ids.is_cpu
        and block_table.is_cpu
        and slots.is_contiguous()
        and qsl.is_contiguous()
        and sample_rows.is_contiguous()
        and num_computed.is_contiguous()
        and token_ids.is_contiguous()
        and block_table.is_contiguous()
    ):
        for t, name, dtype in (
            (slots, "slots", i64),
            (qsl, "qsl", i32),
            (sample_rows, "sample_rows", i64),
            (num_computed, "num_computed", i64),
            (token_ids, "token_ids", i64),
            (block_table, "block_table", i32),
        ):
            check_cpu(t, name, dtype)
        raise ValueError("prepare_inputs needs contiguous tensors")
    num_reqs = slots.shape[0]
    if qsl.shape != (num_reqs + 1,) or not 0 <= max_blocks <= block_table.shape[1]:
        raise ValueError(
            f"qsl {tuple(qsl.shape)} / max_blocks {max_blocks} do not match "
            f"{num_reqs} requests and a block table {tuple(block_table.shape)}"
        )
    num_samples = sample_rows.shape[0]
    if out is None:
        out = empty_outputs(slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    else:
        check_outputs(out, slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    library().prepare_inputs_i64(
        slots.data_ptr(),
        qsl.data_ptr(),
        num_reqs,
        num_computed.data_ptr(),
        token_ids.data_ptr(),
        token_ids.stride(0),
        block_table.data_ptr(),
        block_table.stride(0),
        block_size,
        max_blocks,
        sample_rows.data_ptr(),
        num_samples,
        *(t.data_ptr() for t in out),
    )
    return out


class PrepareFn(Protocol):
    """The contract: (slots, qsl, sample_rows, num_computed, token_ids, block_table, block_size,
    num_tokens, max_blocks, out=None) -> PreparedInputs; with out (tensors as empty_outputs
    makes them for the step, e.g. the last step's when its shape repeats) the results are
    written there and out is returned, without allocating."""

    def __call__(
        self,
        slots: torch.Tensor,
        qsl: torch.Tensor,
        sample_rows: torch.Tensor,
        num_computed: torch.Tensor,
        token_ids: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        num_tokens: int,
        max_blocks: int,
        out: PreparedInputs | None = None,
    ) -> PreparedInputs: ...


def _triton() -> PrepareFn:
    """The Triton launcher, imported only when a CUDA device asks for it."""
    from kernels.triton.prepare_inputs import prepare_inputs_triton

    return prepare_inputs_triton


def prepare_inputs_for(device: torch.device) -> PrepareFn:
    """The implementation for a device: the Triton kernel on CUDA, the C one on a CPU where the
    kernels are built, torch ops otherwise. Each takes (slots, qsl, sample_rows, num_computed,
    token_ids, block_table, block_size, num_tokens, max_blocks, out=None)."""
    return kernel_for(device, _triton, prepare_inputs_cpu, prepare_inputs_torch)
