"""kernels.prepare_inputs: the Triton kernel (under the interpreter without a GPU) and the C one
against the torch-op reference, on a step mixing prefill chunks and decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_binding
from kernels.prepare_inputs import (
    empty_outputs,
    prepare_inputs_cpu,
    prepare_inputs_for,
    prepare_inputs_torch,
)
from kernels.triton.prepare_inputs import prepare_inputs_triton
from tests.kernels.paged_inputs import DEVICE

BLOCK_SIZE = 16


def _step(device: str, seed: int = 0):
    """Persistent tables of 12 slots and a step over 6 of them (chunks of 1..40 tokens, some
    rows not sampling), as the runner would hand them over."""
    rng = np.random.default_rng(seed)
    num_slots, width, max_blocks = 12, 200, 13
    token_ids = torch.from_numpy(rng.integers(0, 50_000, (num_slots, width)))
    block_table = torch.from_numpy(
        rng.permutation(num_slots * max_blocks).reshape(num_slots, max_blocks).astype(np.int32)
    )
    num_computed = torch.from_numpy(rng.integers(0, 150, num_slots))
    slots = torch.tensor([7, 2, 11, 0, 5, 9])
    query_lens = np.array([1, 40, 1, 17, 1, 3])
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
    sample_rows = torch.tensor([0, 2, 3, 4])  # rows 1 and 5 are mid-prompt chunks
    seq_lens = num_computed[slots].numpy() + query_lens
    step_blocks = int(-(-seq_lens.max() // BLOCK_SIZE))
    args = [slots, qsl, sample_rows, num_computed, token_ids, block_table]
    return ([a.to(device) for a in args], int(query_lens.sum()), step_blocks)


def _assert_equal(got, want) -> None:
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w.cpu()), name


def test_reference_reads_the_tables_as_documented() -> None:
    (slots, qsl, sample_rows, computed, tokens, blocks), num_tokens, step_blocks = _step("cpu")
    out = prepare_inputs_torch(
        slots, qsl, sample_rows, computed, tokens, blocks, BLOCK_SIZE, num_tokens, step_blocks
    )
    # Request 1 (slot 2) computes 40 tokens from its computed count onward.
    start, c = int(qsl[1]), int(computed[2])
    assert out.positions[start : start + 40].tolist() == list(range(c, c + 40))
    assert out.input_ids[start : start + 40].tolist() == tokens[2, c : c + 40].tolist()
    pos = c + 39
    assert int(out.slot_mapping[start + 39]) == (
        int(blocks[2, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
    )
    assert out.seq_lens.tolist() == (computed[slots] + qsl[1:].long() - qsl[:-1].long()).tolist()
    assert out.logits_indices.tolist() == [0, 41, 58, 59]
    assert out.sample_slots.tolist() == [7, 11, 0, 5]
    assert torch.equal(out.block_table, blocks[slots, :step_blocks])


def test_triton_kernel_matches_the_reference() -> None:
    args, num_tokens, step_blocks = _step(DEVICE)
    want = prepare_inputs_torch(*args, BLOCK_SIZE, num_tokens, step_blocks)
    _assert_equal(prepare_inputs_triton(*args, BLOCK_SIZE, num_tokens, step_blocks), want)


@pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")
def test_c_kernel_matches_the_reference() -> None:
    for seed in range(3):
        args, num_tokens, step_blocks = _step("cpu", seed)
        want = prepare_inputs_torch(*args, BLOCK_SIZE, num_tokens, step_blocks)
        _assert_equal(prepare_inputs_cpu(*args, BLOCK_SIZE, num_tokens, step_blocks), want)
    # An empty step, and arguments it would misread.
    empty = [
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        *args[3:],
    ]
    assert prepare_inputs_cpu(*empty, BLOCK_SIZE, 0, 0).input_ids.shape == (0,)
    with pytest.raises(ValueError, match="int32"):
        prepare_inputs_cpu(args[0], args[1].long(), *args[2:], BLOCK_SIZE, num_tokens, 1)
    with pytest.raises(ValueError, match="max_blocks"):
        prepare_inputs_cpu(*args, BLOCK_SIZE, num_tokens, 99)


def test_each_device_gets_its_kernel() -> None:
    assert prepare_inputs_for(torch.device("cuda")) is prepare_inputs_triton
    expected = prepare_inputs_cpu if cpu_binding.available() else prepare_inputs_torch
    assert prepare_inputs_for(torch.device("cpu")) is expected


def _implementations() -> list:
    impls = [("torch", prepare_inputs_torch, "cpu"), ("triton", prepare_inputs_triton, DEVICE)]
    if cpu_binding.available():
        impls.append(("c", prepare_inputs_cpu, "cpu"))
    return impls


@pytest.mark.parametrize("name", ["torch", "triton", "c"])
def test_out_is_filled_in_place_step_after_step(name: str) -> None:
    """With out (as empty_outputs makes it), each implementation writes the step there and
    returns it: a buffer reused over steps of one shape holds each step's inputs exactly, and
    one that does not fit the step is refused before anything is written."""
    impls = {n: (fn, device) for n, fn, device in _implementations()}
    if name not in impls:
        pytest.skip("no C compiler on this machine")
    fn, device = impls[name]
    args, num_tokens, step_blocks = _step(device, 0)
    num_reqs, num_samples = args[0].shape[0], args[2].shape[0]
    out = empty_outputs(torch.device(device), num_reqs, num_tokens, step_blocks, num_samples)
    for t in out:
        t.fill_(-7)  # stale contents, all overwritten
    for seed in (0, 4, 6):  # steps of one shape (63 tokens, 10 blocks), different tables
        args, num_tokens, step_blocks = _step(device, seed)
        assert (num_tokens, step_blocks) == (out.input_ids.shape[0], out.block_table.shape[1])
        want = prepare_inputs_torch(*[a.cpu() for a in args], BLOCK_SIZE, num_tokens, step_blocks)
        got = fn(*args, BLOCK_SIZE, num_tokens, step_blocks, out)
        assert got is out
        _assert_equal(got, want)
    wrong = empty_outputs(torch.device(device), num_reqs, num_tokens + 1, step_blocks, num_samples)
    with pytest.raises(ValueError, match="out does not match"):
        fn(*args, BLOCK_SIZE, num_tokens, step_blocks, wrong)
    as_int32 = out._replace(input_ids=out.input_ids.to(torch.int32))
    with pytest.raises(ValueError, match="out does not match"):
        fn(*args, BLOCK_SIZE, num_tokens, step_blocks, as_int32)
    strided = out._replace(positions=torch.empty(2 * num_tokens, dtype=torch.int64)[::2])
    with pytest.raises(ValueError, match="out does not match"):
        fn(*args, BLOCK_SIZE, num_tokens, step_blocks, strided)
