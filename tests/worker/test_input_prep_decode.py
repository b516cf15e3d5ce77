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
