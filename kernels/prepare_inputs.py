"""A step's model inputs gathered on the device from the runner's persistent request state.

Request i of a step computes tokens qsl[i]..qsl[i+1] of the packed batch, at positions
num_computed[slot] onward of its slot slots[i]. From those two small arrays (copied from the host
once per step) and the persistent tables, one kernel writes the input ids (a decode's is the
token the previous step's post-update wrote into token_ids), positions, sequence lengths, KV
slot mapping, the step's block-table rows, and for the rows that sample (sample_rows) their
logits row and slot. Three implementations with one contract: a Triton kernel (CUDA,
kernels/prepare_inputs_triton.py), its C twin (kernels/cpu/prepare_inputs.c, via kernels.cpu_ops)
and torch ops here (the reference, and the path without either).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.dispatch import kernel_for
from kernels.prepared_inputs import PreparedInputs, check_outputs


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


def prepare_inputs_for(device: torch.device) -> PrepareFn:
    """The implementation for a device: the Triton kernel on CUDA, the C one on a CPU where the
    kernels are built, torch ops otherwise. Each takes (slots, qsl, sample_rows, num_computed,
    token_ids, block_table, block_size, num_tokens, max_blocks, out=None)."""

    def triton_impl() -> PrepareFn:
        from kernels.prepare_inputs_triton import prepare_inputs_triton

        return prepare_inputs_triton

    return kernel_for(device, triton_impl, "prepare_inputs", prepare_inputs_torch)
