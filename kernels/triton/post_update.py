"""post_update_triton, kernels/post_update.py's contract as one Triton launch of one program per
request. Imported only where it runs: on CUDA (post_update_for), and in the tests under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_samples"])
def _post_update_kernel(
    slots_ptr,
    seq_lens_ptr,
    sample_slots_ptr,
    sampled_ptr,
    num_samples,
    num_computed_ptr,
    num_tokens_ptr,
    token_ids_ptr,
    token_stride,
    num_output_ptr,
):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    tl.store(num_computed_ptr + slot, tl.load(seq_lens_ptr + i).to(tl.int64))
    if i < num_samples:  # S <= B: program i also appends sampling row i's token
        s = tl.load(sample_slots_ptr + i)
        n = tl.load(num_tokens_ptr + s)
        tl.store(token_ids_ptr + s * token_stride + n, tl.load(sampled_ptr + i))
        tl.store(num_tokens_ptr + s, n + 1)
        tl.store(num_output_ptr + s, tl.load(num_output_ptr + s) + 1)


def post_update_triton(
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    sample_slots: torch.Tensor,
    sampled: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    num_output: torch.Tensor,
) -> None:
    """One launch of one program per request of the step."""
    if slots.shape[0]:
        _post_update_kernel[(slots.shape[0],)](
            slots,
            seq_lens,
            sample_slots,
            sampled,
            sample_slots.shape[0],
            num_computed,
            num_tokens,
            token_ids,
            token_ids.stride(0),
            num_output,
        )
