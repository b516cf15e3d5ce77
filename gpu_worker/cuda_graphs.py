"""CUDA graphs for decode-only steps: vLLM's "full graph for uniform decode".

A decode step of a large model launches hundreds of small kernels, and on a GPU the host's launch
time, not the device, sets the step's length. At start-up the model's forward is captured once
per batch size in the capture list, reading its inputs from persistent buffers (DecodeInputs);
a decode step of B requests writes its inputs straight into those buffers (InputPreparer) and
replays the graph of the smallest captured size >= B. Mixed and prefill steps run eagerly.

Padded rows (B..size) compute garbage that nothing reads: their slot mapping is -1, so they
write no KV, and their sequence length is 1, so attention reads one valid block. The rows keep
whatever ids, positions and block-table entries an earlier step left, all valid values.

Attention's split-context decode (kernels/paged_decode.py) picks its grid from the longest
context, a host value; a graph is captured with the grid of max_model_len, whose partitions past
a sequence's length return at once, so sizes that split get a second graph for long contexts.
All graphs share one memory pool, captured largest first so smaller ones reuse its blocks.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.forward_context import forward_context
from gpu_worker.layers.attention import StepAttention
from kernels.prepared_inputs import PreparedInputs

if TYPE_CHECKING:
    from gpu_worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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


class DecodeGraphs:
    """The captured graphs, by (size, whether attention splits the context), and their
    outputs (hidden states [size, hidden] in the shared pool)."""

    def __init__(self, runner: ModelRunner, inputs: DecodeInputs) -> None:
        self.runner = runner
        self.inputs = inputs
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_kv_heads = runner.kv_caches[0].shape[3]
        self.max_model_len = runner.config.max_model_len
        self.pool_bytes = 0
        # size -> its metadata, whose max_seq_len _splits sets to ask the backend.
        self._probes = {size: inputs.metadata(size, 0) for size in inputs.sizes}

    def _splits(self, size: int, max_seq_len: int) -> bool:
        """Whether attention splits the context of a size-row decode step (host values)."""
        probe = self._probes[size]
        probe.max_seq_len = max_seq_len
        return bool(
            self.runner.backend.uses_split_decode(probe, self.num_kv_heads, self.runner.device)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, with and without the split-context attention
        where a long context would split; logs the time and the memory the graphs hold."""
        model = self.runner.model
        assert model is not None
        device = self.runner.device
        start = time.perf_counter()
        gc.collect()
        torch.cuda.synchronize(device)
        # Capturing empties the allocator's cache (torch.cuda.graph does): empty it first, or
        # the blocks it frees would count against the graphs' own.
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        ids, positions = self.inputs.input_ids, self.inputs.positions
        for size in reversed(self.inputs.sizes):
            variants = [(False, 1)]
            if self._splits(size, self.max_model_len):
                variants.append((True, self.max_model_len))
            for split, max_seq_len in variants:
                meta = self.inputs.metadata(size, max_seq_len)
                assert self._splits(size, max_seq_len) == split
                with forward_context(StepAttention(self.runner.backend, meta)):
                    model(ids[:size], positions[:size])  # compiles and allocates outside
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = model(ids[:size], positions[:size])
                self.graphs[(size, split)] = (graph, hidden)
        torch.cuda.synchronize(device)
        self.pool_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "CUDA graphs: %d captured (decode batch sizes %s) in %.1f s, holding %.0f MiB",
            len(self.graphs),
            _ranges(self.inputs.sizes),
            time.perf_counter() - start,
            self.pool_bytes / 2**20,
        )

    def replay(self, num_reqs: int, max_seq_len: int) -> torch.Tensor | None:
        """Run the graph for a decode step of num_reqs requests whose inputs are in the buffers;
        its hidden states [num_reqs, hidden], or None when no graph fits (run it eagerly)."""
        size = self.inputs.padded_size(num_reqs)
        entry = self.graphs.get((size, self._splits(size, max_seq_len))) if size else None
        if entry is None:
            return None
        self.inputs.pad(num_reqs, size)
        graph, hidden = entry
        graph.replay()
        return hidden[:num_reqs]


def _ranges(sizes: list[int]) -> str:
    """'1, 2, 4, 8-256 by 8' for the log line."""
    head = [s for s in sizes if s < 8]
    tail = [s for s in sizes if s >= 8]
    if len(tail) > 2 and all(b - a == 8 for a, b in zip(tail, tail[1:])):
        return ", ".join([*map(str, head), f"{tail[0]}-{tail[-1]} by 8"])
    return ", ".join(map(str, sizes))
