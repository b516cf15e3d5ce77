"""A step's post-update of the model runner's persistent request state, on the device.

Each request of the step has computed up to seq_lens[i] (num_computed[slots[i]]); each request
that sampled (sample_slots[j]) gains its sampled token, written after its known tokens in
token_ids, so the next step reads it as its input id, and counts it in num_tokens and
num_output. One kernel, three implementations: Triton (CUDA), C (kernels/cpu/post_update.c, via
kernels.cpu_ops) and torch ops (the reference, and the path without either).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.dispatch import kernel_for

PostUpdateFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ],
    None,
]


def post_update_torch(
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    sample_slots: torch.Tensor,
    sampled: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    num_output: torch.Tensor,
) -> None:
    """The reference, in torch ops on any device."""
    num_computed.index_copy_(0, slots, seq_lens.to(torch.int64))
    if not sample_slots.shape[0]:
        return
    at = sample_slots * token_ids.stride(0) + num_tokens.index_select(0, sample_slots)
    token_ids.view(-1).index_copy_(0, at, sampled)
    ones = torch.ones_like(sample_slots)
    num_tokens.index_add_(0, sample_slots, ones)
    num_output.index_add_(0, sample_slots, ones)


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


def post_update_for(device: torch.device) -> PostUpdateFn:
    """The implementation for a device: Triton on CUDA, C on a CPU where the kernels are built,
    torch ops otherwise. Each takes (slots, seq_lens, sample_slots, sampled, num_computed,
    num_tokens, token_ids, num_output) and updates the last four in place."""
    return kernel_for(device, lambda: post_update_triton, "post_update", post_update_torch)
