"""Structured outputs on the worker: the step's grammar bitmask applied to the logits of the
constrained requests before sampling (so their logprobs, too, are those of the allowed tokens)."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.input_batch import InputBatch
from gpu_worker.staging import HostToDevice
from kernels.grammar_bitmask import apply_token_bitmask
from protocol.step import SchedulerOutput


def grammar_rows(
    sched: SchedulerOutput,
    batch: InputBatch,
    verify_starts: np.ndarray | None = None,
    num_drafts: np.ndarray | None = None,
) -> np.ndarray:
    """The logits row of each row of the bitmask: one per constrained request, in the order
    of structured_output_request_ids; in a speculative step (verify_starts, num_drafts: each
    sampling request's first verification row and drafts) 1 + drafts rows per request."""
    position = {req_id: i for i, req_id in enumerate(batch.req_ids)}
    sample_index = np.full(len(batch.req_ids), -1, dtype=np.int64)
    sample_index[batch.sample_rows_np] = np.arange(len(batch.sample_rows_np))
    index = sample_index[[position[r] for r in sched.structured_output_request_ids]]
    if (index < 0).any():
        raise RuntimeError(
            "the scheduler sent a grammar bitmask for a request that does not sample in this step"
        )
    if verify_starts is None or num_drafts is None:
        return index
    counts = num_drafts[index] + 1
    starts = verify_starts[index]
    first = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return first + np.arange(int(counts.sum()), dtype=np.int64)


def apply_grammar_bitmask(
    logits: torch.Tensor,
    sched: SchedulerOutput,
    batch: InputBatch,
    h2d: HostToDevice,
    verify_starts: np.ndarray | None = None,
    num_drafts: np.ndarray | None = None,
) -> None:
    """Forbid, in place, the tokens the constrained requests' grammars do not allow now (in a
    speculative step: at each verification row of theirs)."""
    rows_np = grammar_rows(sched, batch, verify_starts, num_drafts)
    bitmask_np = np.frombuffer(sched.grammar_bitmask, dtype="<i4").reshape(len(rows_np), -1)
    if logits.is_cpu:  # the bytes are read-only; the CPU kernel only reads them
        bitmask, rows = torch.from_numpy(bitmask_np.copy()), torch.from_numpy(rows_np)
    else:
        bitmask, rows = h2d.copy(bitmask_np.astype(np.int32), rows_np)
    apply_token_bitmask(logits, bitmask, rows)
