"""What every attention backend is told about one step's batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepBatch:
    """Host-side description of a step: requests packed one after another."""

    query_start_loc: np.ndarray  # [B+1] int32, cumulative query lengths
    seq_lens: np.ndarray  # [B] int32, context length including this step's tokens
    block_table: np.ndarray  # [B, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    block_size: int

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@dataclass(slots=True)
class DeviceBatch:
    """The same arrays on the device, shared by the backends."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @classmethod
    def from_step(cls, step: StepBatch, device: torch.device) -> DeviceBatch:
        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        q_lens = step.query_lens
        return cls(
            query_start_loc=to(step.query_start_loc),
            seq_lens=to(step.seq_lens),
            block_table=to(step.block_table),
            slot_mapping=to(step.slot_mapping),
            max_query_len=int(q_lens.max()) if len(q_lens) else 0,
            max_seq_len=int(step.seq_lens.max()) if len(step.seq_lens) else 0,
        )
