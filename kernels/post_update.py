"""A step's post-update of the model runner's persistent request state, on the device.

Each request of the step has computed up to seq_lens[i] (num_computed[slots[i]]); each request
that sampled (sample_slots[j]) gains its sampled token, written after its known tokens in
token_ids, so the next step reads it as its input id, and counts it in num_tokens and
num_output. One kernel, three implementations side by side: torch ops (the reference, and the
path without either), Triton (CUDA, kernels/triton/post_update.py) and C
(kernels/cpu/post_update.c); post_update_for() picks one for a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu_binding import check_cpu, library
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


def post_update_cpu(
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    sample_slots: torch.Tensor,
    sampled: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    num_output: torch.Tensor,
) -> None:
    """kernels.post_update's contract in one C call (kernels/cpu/post_update.c)."""
    i64 = torch.int64
    # Once per step: the whole check in one expression, the messages only when it fails.
    if not (
        slots.dtype is i64
        and seq_lens.dtype is torch.int32
        and sample_slots.dtype is i64
        and sampled.dtype is i64
        and num_computed.dtype is i64
        and num_tokens.dtype is i64
        and token_ids.dtype is i64
        and num_output.dtype is i64
        and slots.is_cpu
        and seq_lens.is_cpu
        and sample_slots.is_cpu
        and sampled.is_cpu
        and num_computed.is_cpu
        and num_tokens.is_cpu
        and token_ids.is_cpu
        and num_output.is_cpu
        and slots.is_contiguous()
        and seq_lens.is_contiguous()
        and sample_slots.is_contiguous()
        and sampled.is_contiguous()
        and num_computed.is_contiguous()
        and num_tokens.is_contiguous()
        and token_ids.is_contiguous()
        and num_output.is_contiguous()
    ):
        for t, name, dtype in (
            (slots, "slots", i64),
            (seq_lens, "seq_lens", torch.int32),
            (sample_slots, "sample_slots", i64),
            (sampled, "sampled", i64),
            (num_computed, "num_computed", i64),
            (num_tokens, "num_tokens", i64),
            (token_ids, "token_ids", i64),
            (num_output, "num_output", i64),
        ):
            check_cpu(t, name, dtype)
            if not t.is_contiguous():
                raise ValueError(f"post_update needs a contiguous {name}")
    if seq_lens.shape != slots.shape or sampled.shape != sample_slots.shape:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} / sampled {tuple(sampled.shape)} "
            f"do not match slots {tuple(slots.shape)} / sample_slots "
            f"{tuple(sample_slots.shape)}"
        )
    library().post_update_i64(
        slots.data_ptr(),
        seq_lens.data_ptr(),
        slots.shape[0],
        sample_slots.data_ptr(),
        sampled.data_ptr(),
        sample_slots.shape[0],
        num_computed.data_ptr(),
        num_tokens.data_ptr(),
        token_ids.data_ptr(),
        token_ids.stride(0),
        num_output.data_ptr(),
    )


def _triton() -> PostUpdateFn:
    """The Triton launcher, imported only when a CUDA device asks for it."""
    from kernels.triton.post_update import post_update_triton

    return post_update_triton


def post_update_for(device: torch.device) -> PostUpdateFn:
    """The implementation for a device: Triton on CUDA, C on a CPU where the kernels are built,
    torch ops otherwise. Each takes (slots, seq_lens, sample_slots, sampled, num_computed,
    num_tokens, token_ids, num_output) and updates the last four in place."""
    cpu_impl: PostUpdateFn = post_update_cpu  # F is the contract, not this def's own signature
    return kernel_for(device, _triton, cpu_impl, post_update_torch)
