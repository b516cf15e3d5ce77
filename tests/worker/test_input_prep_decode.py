"""InputPreparer's decode shortcut (a step of single-token requests reuses 0..B as its query
start locations and, when all sample, as its sampling rows) against its general path, and
HostToDevice's reuse of the last call's tensors on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.input_batch import InputPreparer
from gpu_worker.request_state import RequestStates
from gpu_worker.staging import HostToDevice


def _states(computed: list[int], num_tokens: list[int]) -> tuple[RequestStates, InputPreparer]:
    device = torch.device("cpu")
    h2d = HostToDevice(device)
    states = RequestStates(8, 64, 4, device, h2d)
    for i, (c, n) in enumerate(zip(computed, num_tokens, strict=True)):
        states.add(f"r{i}", list(range(10 + i, 10 + i + n)), 3, list(range(i * 16, i * 16 + 16)), c)
    states.apply_staged_writes()
    return states, InputPreparer(states, h2d, device)


def _fields(batch) -> dict:
    out = {}
    for name in (
        "slots_np",
        "query_start_loc_np",
        "seq_lens_np",
        "sample_rows_np",
        "sample_slots_np",
        "block_table_np",
    ):
        out[name] = np.asarray(getattr(batch, name)).tolist()
    for name in ("slots", "sample_slots", "logits_indices", "input_ids", "positions"):
        out[name] = getattr(batch, name).tolist()
    db = batch.device_batch
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        out["db." + name] = getattr(db, name).tolist()
    out["max_query_len"], out["max_seq_len"] = db.max_query_len, db.max_seq_len
    return out


@pytest.mark.parametrize(
    ("computed", "num_tokens"),
    [
        ([5, 9, 3], [6, 10, 4]),  # every request decodes and samples
        ([5, 2, 3], [6, 9, 4]),  # the second is mid-prompt: one token, no sample
        ([0], [1]),
    ],
)
def test_decode_shortcut_matches_the_general_path(computed, num_tokens) -> None:
    ids = [f"r{i}" for i in range(len(computed))]
    ones = np.ones(len(ids), dtype=np.int64)
    _, prep = _states(computed, num_tokens)
    general = _fields(prep.prepare(list(ids), ones))
    _, prep = _states(computed, num_tokens)
    shortcut = prep.prepare(list(ids), ones, len(ids))
    assert _fields(shortcut) == general
    all_sample = len(shortcut.sample_rows_np) == len(ids)
    assert (shortcut.sample_slots_np is shortcut.slots_np) == all_sample


def test_mixed_step_with_a_known_total_takes_the_general_path() -> None:
    _, prep = _states([0, 9], [5, 10])
    counts = np.array([5, 1], dtype=np.int64)
    general = _fields(prep.prepare(["r0", "r1"], counts))
    _, prep = _states([0, 9], [5, 10])
    assert _fields(prep.prepare(["r0", "r1"], counts, 6)) == general


def test_cpu_copy_reuses_the_last_calls_tensor_of_the_same_array() -> None:
    h2d = HostToDevice(torch.device("cpu"))
    a, b = np.arange(4), np.arange(3)
    ta, tb = h2d.copy(a, b)
    ta2, tc = h2d.copy(a, b.copy())
    assert ta2 is ta and tc is not tb
    assert tc.data_ptr() != tb.data_ptr() and tc.tolist() == [0, 1, 2]
    assert ta.data_ptr() == a.__array_interface__["data"][0]


def test_cpu_steps_of_one_shape_refill_the_last_steps_tensors() -> None:
    """On the CPU the gathered inputs of a step go into the last step's tensors when the shape
    (requests, tokens, blocks, sampling rows) repeats; each step's contents are its own, as a
    fresh preparer's (the same step from scratch) shows, and a new shape gets new tensors."""
    ids = ["r0", "r1", "r2"]
    ones = np.ones(3, dtype=np.int64)
    states, prep = _states([5, 9, 3], [6, 10, 4])
    first = prep.prepare(ids, ones, 3)
    kept = _fields(first)
    tensors = [first.input_ids, first.positions, first.device_batch.block_table]
    # The device's post-update and its mirrors: each request gained its sampled token.
    batch = first
    for step in range(2):
        states.post_update(
            batch.slots,
            batch.slots_np,
            batch.device_batch.seq_lens,
            batch.seq_lens_np,
            batch.sample_slots,
            batch.sample_slots_np,
            torch.tensor([70 + step, 80 + step, 90 + step]),
            torch.zeros(8, dtype=torch.int64),
        )
        second = prep.prepare(ids, ones, 3)
        assert second.input_ids is tensors[0] and second.positions is tensors[1]
        assert second.device_batch.block_table is tensors[2]
        assert second.input_ids.tolist() == [70 + step, 80 + step, 90 + step]
        batch = second
    fresh = InputPreparer(states, prep.h2d, torch.device("cpu"))
    assert _fields(second) == _fields(fresh.prepare(ids, ones, 3))
    assert kept["input_ids"] == [15, 20, 15] and kept != _fields(second)
    # r1 reaches a new block (block_size 4): max_blocks grows, new tensors.
    states.post_update(
        second.slots,
        second.slots_np,
        second.device_batch.seq_lens,
        second.seq_lens_np,
        second.sample_slots,
        second.sample_slots_np,
        torch.tensor([1, 2, 3]),
        torch.zeros(8, dtype=torch.int64),
    )
    third = prep.prepare(ids, ones, 3)
    assert third.device_batch.block_table.shape[1] != tensors[2].shape[1]
    assert third.input_ids is not tensors[0]
    fresh = InputPreparer(states, prep.h2d, torch.device("cpu"))
    assert _fields(third) == _fields(fresh.prepare(ids, ones, 3))


def test_block_appends_of_a_step_match_one_by_one() -> None:
    """RequestStates.append_blocks_of (the runner's per-step call) against append_blocks for
    each request: the host mirror, the counts and the device table after the staged writes."""
    device = torch.device("cpu")

    def states() -> RequestStates:
        s = RequestStates(6, 64, 4, device, HostToDevice(device))
        for i in range(5):
            s.add(f"r{i}", [1, 2, 3, 4, 5], 5, [10 * i, 10 * i + 1], 5)
        s.apply_staged_writes()
        return s

    req_ids = ["r3", "r0", "r4", "r1", "r2"]
    new = [[31], (), [41, 42, 43], [11], ()]
    one, batched = states(), states()
    for rid, blocks in zip(req_ids, new):
        if blocks:
            one.append_blocks(one.slot_of[rid], list(blocks))
    batched.append_blocks_of(req_ids, [list(b) for b in new])
    for s in (one, batched):
        s.apply_staged_writes()
    assert one.num_blocks == batched.num_blocks
    assert np.array_equal(one.block_table_np, batched.block_table_np)
    assert torch.equal(one.block_table, batched.block_table)
    assert torch.equal(batched.block_table, torch.from_numpy(batched.block_table_np))
