"""prepare_inputs_triton, kernels/prepare_inputs.py's contract as one Triton launch of one program
per request. Imported only where it runs: on CUDA (prepare_inputs_for), and in the tests under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.step_inputs import PreparedInputs, check_outputs, empty_outputs


# Arguments that change every step must not make Triton compile a variant per value.
@triton.jit(do_not_specialize=["num_samples", "max_blocks"])
def _prepare_inputs_kernel(
    slots_ptr,
    qsl_ptr,
    num_computed_ptr,
    token_ids_ptr,
    token_stride,
    block_table_ptr,
    block_stride,
    sample_rows_ptr,
    num_samples,
    max_blocks,
    input_ids_ptr,
    positions_ptr,
    seq_lens_ptr,
    slot_mapping_ptr,
    block_table_out_ptr,
    logits_indices_ptr,
    sample_slots_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    q0 = tl.load(qsl_ptr + i).to(tl.int64)
    q1 = tl.load(qsl_ptr + i + 1).to(tl.int64)
    computed = tl.load(num_computed_ptr + slot)
    tl.store(seq_lens_ptr + i, (computed + q1 - q0).to(tl.int32))
    offs = tl.arange(0, BLOCK)
    tokens = token_ids_ptr + slot * token_stride
    blocks = block_table_ptr + slot * block_stride
    for start in range(q0, q1, BLOCK):
        t = start + offs
        mask = t < q1
        pos = computed + t - q0
        tl.store(positions_ptr + t, pos, mask=mask)
        tl.store(input_ids_ptr + t, tl.load(tokens + pos, mask=mask), mask=mask)
        block = tl.load(blocks + pos // BLOCK_SIZE, mask=mask).to(tl.int64)
        tl.store(slot_mapping_ptr + t, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    row_out = block_table_out_ptr + i.to(tl.int64) * max_blocks
    for start in range(0, max_blocks, BLOCK):
        b = start + offs
        mask = b < max_blocks
        tl.store(row_out + b, tl.load(blocks + b, mask=mask), mask=mask)
    if i < num_samples:  # S <= B: program i also fills sampling row i
        row = tl.load(sample_rows_ptr + i)
        tl.store(logits_indices_ptr + i, tl.load(qsl_ptr + row + 1).to(tl.int64) - 1)
        tl.store(sample_slots_ptr + i, tl.load(slots_ptr + row))


def prepare_inputs_triton(
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
    """One launch of one program per request (into out's tensors when given)."""
    num_reqs, num_samples = slots.shape[0], sample_rows.shape[0]
    if out is None:
        out = empty_outputs(slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    else:
        check_outputs(out, slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    if slots.shape[0]:
        _prepare_inputs_kernel[(slots.shape[0],)](
            slots,
            qsl,
            num_computed,
            token_ids,
            token_ids.stride(0),
            block_table,
            block_table.stride(0),
            sample_rows,
            sample_rows.shape[0],
            max_blocks,
            *out,
            BLOCK_SIZE=block_size,
            BLOCK=128,
        )
    return out
