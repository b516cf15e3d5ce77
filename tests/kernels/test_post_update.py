"""kernels.post_update: the Triton kernel (under the interpreter without a GPU) and the C one
against the torch-op reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_binding
from kernels.post_update import post_update_cpu, post_update_for, post_update_torch
from kernels.triton.post_update import post_update_triton
from tests.kernels.paged_inputs import DEVICE


def _state(device: str):
    """Persistent state of 8 slots; a step over 5 of them, 3 of which sampled."""
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, 1000, (8, 40), generator=gen)
    num_tokens = torch.randint(5, 30, (8,), generator=gen)
    num_computed = num_tokens - 1
    num_output = torch.randint(0, 5, (8,), generator=gen)
    slots = torch.tensor([6, 1, 3, 0, 4])
    seq_lens = num_computed[slots].to(torch.int32) + torch.tensor(
        [1, 1, 9, 1, 1], dtype=torch.int32
    )
    sample_slots = torch.tensor([6, 1, 4])
    sampled = torch.tensor([901, 902, 903])
    tensors = [
        slots,
        seq_lens,
        sample_slots,
        sampled,
        num_computed,
        num_tokens,
        token_ids,
        num_output,
    ]
    return [t.to(device) for t in tensors]


def _run(fn, device: str) -> list[torch.Tensor]:
    state = _state(device)
    fn(*state)
    return [t.cpu() for t in state[4:]]


def test_reference_appends_the_sampled_tokens() -> None:
    before = _state("cpu")
    num_computed, num_tokens, token_ids, num_output = _run(post_update_torch, "cpu")
    assert num_computed[[6, 1, 3, 0, 4]].tolist() == before[1].tolist()
    assert (num_tokens - before[5]).tolist() == [0, 1, 0, 0, 1, 0, 1, 0]
    assert (num_output - before[7]).tolist() == [0, 1, 0, 0, 1, 0, 1, 0]
    for slot, token in ((6, 901), (1, 902), (4, 903)):
        assert int(token_ids[slot, int(before[5][slot])]) == token
    assert int((token_ids != before[6]).sum()) == 3


def test_triton_kernel_matches_the_reference() -> None:
    want = _run(post_update_torch, DEVICE)
    for got, w in zip(_run(post_update_triton, DEVICE), want):
        assert torch.equal(got, w)


@pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")
def test_c_kernel_matches_the_reference() -> None:
    want = _run(post_update_torch, "cpu")
    for got, w in zip(_run(post_update_cpu, "cpu"), want):
        assert torch.equal(got, w)
    state = _state("cpu")
    with pytest.raises(ValueError, match="int32"):
        post_update_cpu(state[0], state[1].long(), *state[2:])
    with pytest.raises(ValueError, match="do not match"):
        post_update_cpu(state[0], state[1], state[2], state[3][:2], *state[4:])


def test_each_device_gets_its_kernel() -> None:
    assert post_update_for(torch.device("cuda")) is post_update_triton
    expected = post_update_cpu if cpu_binding.available() else post_update_torch
    assert post_update_for(torch.device("cpu")) is expected
