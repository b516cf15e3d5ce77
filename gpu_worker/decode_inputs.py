"""The persistent input buffers of the decode CUDA graphs (gpu_worker/cuda_graphs.py).

A decode step that a captured graph covers has its inputs written straight into these buffers
(gpu_worker/input_batch.py), and the graph, captured over them, reads them at replay. Both sides
import this module; neither imports the other.

Padded rows (B..size) compute garbage that nothing reads: their slot mapping is -1, so they
write no KV, and their sequence length is 1, so attention reads one valid block. The rows keep
whatever ids, positions and block-table entries an earlier step left, all valid values.
"""

from __future__ import annotations

import torch

from gpu_worker.attention.metadata import DeviceBatch
from kernels.prepare_inputs import PreparedInputs


class DecodeInputs:
    """The persistent input buffers every decode graph reads: rows 0..max_size of token ids,
    positions, sequence lengths, slot mapping and full-width block-table rows."""

    def __init__(self, sizes: list[int], max_blocks: int, device: torch.device) -> None:
        assert sizes == sorted(sizes) and sizes[0] >= 1, sizes
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.max_blocks = max_blocks
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        # Every row is one query token: 0, 1, ..., max_size, never written.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # num_reqs -> the captured size that runs it.
        self._padded = [0] * (n + 1)
        for b in range(1, n + 1):
            self._padded[b] = next(s for s in sizes if s >= b)

    def padded_size(self, num_reqs: int) -> int:
        """The captured size a decode step of num_reqs requests replays, 0 when none fits."""
        return self._padded[num_reqs] if 0 < num_reqs <= self.max_size else 0

    def outputs(self, num_reqs: int, num_samples: int) -> PreparedInputs:
        """Where InputPreparer writes a decode step of num_reqs requests: the buffers' first
        rows (block-table rows at full width), and fresh sampling indices."""
        device = self.input_ids.device
        return PreparedInputs(
            self.input_ids[:num_reqs],
            self.positions[:num_reqs],
            self.seq_lens[:num_reqs],
            self.slot_mapping[:num_reqs],
            self.block_table[:num_reqs],
            torch.empty(num_samples, dtype=torch.int64, device=device),
            torch.empty(num_samples, dtype=torch.int64, device=device),
        )

    def metadata(self, size: int, max_seq_len: int) -> DeviceBatch:
        """The attention metadata of a decode graph of size rows."""
        return DeviceBatch(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )

    def pad(self, num_reqs: int, size: int) -> None:
        """Make rows num_reqs..size harmless: no KV write, one token of context."""
        if size > num_reqs:
            self.slot_mapping[num_reqs:size].fill_(-1)
            self.seq_lens[num_reqs:size].fill_(1)
