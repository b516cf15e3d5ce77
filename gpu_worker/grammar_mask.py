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
    sched: SchedulerOutput, batch: InputBatch, sample_logits_rows: np.ndarray | None = None
) -> np.ndarray:
    """The logits row of each constrained request, in the order of the bitmask's rows
    (sample_logits_rows: each sampling request's logits row, when it is not its index, as in a
    speculative step's verification rows)."""
    position = {req_id: i for i, req_id in enumerate(batch.req_ids)}
    logits_row = np.full(len(batch.req_ids), -1, dtype=np.int64)
    logits_row[batch.sample_rows_np] = (
        np.arange(len(batch.sample_rows_np)) if sample_logits_rows is None else sample_logits_rows
    )
    rows = logits_row[[position[r] for r in sched.structured_output_request_ids]]
    if (rows < 0).any():
        raise RuntimeError(
            "the scheduler sent a grammar bitmask for a request that does not sample in this step"
        )
    return rows


def apply_grammar_bitmask(
    logits: torch.Tensor,
    sched: SchedulerOutput,
    batch: InputBatch,
    h2d: HostToDevice,
    sample_logits_rows: np.ndarray | None = None,
) -> None:
    """Forbid, in place, the tokens the constrained requests' grammars do not allow now."""
    rows_np = grammar_rows(sched, batch, sample_logits_rows)
    bitmask_np = np.frombuffer(sched.grammar_bitmask, dtype="<i4").reshape(len(rows_np), -1)
    if logits.is_cpu:  # the bytes are read-only; the CPU kernel only reads them
        bitmask, rows = torch.from_numpy(bitmask_np.copy()), torch.from_numpy(rows_np)
    else:
        bitmask, rows = h2d.copy(bitmask_np.astype(np.int32), rows_np)
    apply_token_bitmask(logits, bitmask, rows)
