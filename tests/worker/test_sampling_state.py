"""SamplingStates.metadata reuses the parameter-only part of the last step's metadata; across
steps that add requests, reuse slots, change the rows and cross min_tokens, it must equal
metadata gathered from scratch every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gpu_worker.sampling_state import SamplingStates
from gpu_worker.staging import HostToDevice
from protocol.sampling_params import SamplingParams

VOCAB, EOS = 64, 2


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_reused_metadata_equals_metadata_from_scratch() -> None:
    cpu = torch.device("cpu")
    reused = SamplingStates(6, VOCAB, EOS, cpu, HostToDevice(cpu))
    fresh = SamplingStates(6, VOCAB, EOS, cpu, HostToDevice(cpu))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={4: 2.0}),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, allowed_token_ids=[1, 3]),
    ]
    # (slots that sample this step, {slot: params index added before the step})
    steps = [
        ([0, 1], {0: 0, 1: 1}),
        ([0, 1], {}),
        ([0, 1, 2], {2: 2}),
        ([0, 1, 2], {}),
        ([0, 1, 2], {}),
        ([0, 1, 2], {}),
        ([1, 2], {}),
        ([1, 2, 0], {0: 3}),
        ([1, 2, 0], {1: 4}),
        ([1, 2, 0, 3], {3: 5}),
        ([1, 2, 0, 3], {}),
    ]
    for sample_slots, added in steps:
        for states in (reused, fresh):
            for slot, which in added.items():
                states.add(slot, params[which], 0)
            states.apply_staged_writes()
            for slot in added:
                ids = torch.tensor([5, 6, 7])
                states.set_penalty_tokens(slot, ids, ids[:0])
        slots_np = np.array(sample_slots, dtype=np.int64)
        slots = torch.from_numpy(slots_np)
        fresh._static = None
        got, want = reused.metadata(slots_np, slots), fresh.metadata(slots_np, slots)
        assert {r: g.initial_seed() for r, g in got.generators.items()} == {
            r: g.initial_seed() for r, g in want.generators.items()
        }
        for f in dataclasses.fields(want):
            if f.name == "generators":
                continue
            assert _same(getattr(got, f.name), getattr(want, f.name)), (sample_slots, f.name)
        sampled = torch.full((len(sample_slots),), 11)
        for states in (reused, fresh):
            states.num_output.index_add_(0, slots, torch.ones_like(slots))  # the runner's kernel
            states.post_update(slots, slots_np, sampled)
    # The reuse happened (steps 2, 4, 5, 6 and the last ran on an unchanged batch) and the
    # min-tokens ban of slot 2 was gathered while it applied, then dropped.
    assert reused._static is not None
