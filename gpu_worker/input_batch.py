"""Persistent per-request state of the model runner, kept in preallocated numpy arrays.

Each live request owns a row; a step's inputs are gathered from the rows with array
operations, so preparing a step costs no Python work per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_core.sampling_params import SamplingParams
from gpu_worker.attention.metadata import StepBatch


@dataclass(slots=True)
class RequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Prompt logprobs gathered so far; None once sent (or for a request resumed after preemption).
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = field(default_factory=list)


@dataclass(slots=True)
class PreparedStep:
    """Arrays for one step, in the order of req_ids."""

    req_ids: list[str]
    rows: np.ndarray
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    batch: StepBatch
    samples: np.ndarray  # [B] bool: this step reaches the end of the request's known tokens


class InputBatch:
    """Token ids, computed-token counts and block tables of every live request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        # One spare column: a request that reaches max_model_len still records its last sample.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, token_ids: list[int], block_ids: list[int], num_computed: int) -> int:
        """Claim a row for a request holding token_ids; returns the row."""
        if not self._free_rows:
            raise RuntimeError("more live requests than max_num_seqs")
        row = self._free_rows.pop()
        n = len(token_ids)
        if n > self.token_ids.shape[1] - 1:
            raise ValueError(f"request of {n} tokens exceeds max_model_len {self.token_ids.shape[1] - 1}")
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def remove(self, row: int) -> None:
        """Give a row back."""
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Extend a row's block table."""
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def prepare(self, req_ids: list[str], rows: np.ndarray, num_scheduled: np.ndarray) -> PreparedStep:
        """Inputs for a step that computes num_scheduled[i] tokens of the request in rows[i]."""
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(len(rows)), num_scheduled)
        token_rows = rows[token_req]
        computed = self.num_computed[rows]
        positions = computed[token_req] + (np.arange(total) - query_start_loc[token_req])
        seq_lens = (computed + num_scheduled).astype(np.int32)
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_blocks = int(-(-seq_lens.max() // bs)) if len(rows) else 0
        batch = StepBatch(query_start_loc=query_start_loc, seq_lens=seq_lens,
                          block_table=np.ascontiguousarray(self.block_table[rows, :max_blocks]),
                          slot_mapping=slot_mapping, block_size=bs)
        return PreparedStep(req_ids=req_ids, rows=rows, input_ids=self.token_ids[token_rows, positions],
                            positions=positions, batch=batch,
                            samples=seq_lens >= self.num_tokens[rows])
