"""CUDA graphs for decode-only steps: vLLM's "full graph for uniform decode".

A decode step of a large model launches hundreds of small kernels, and on a GPU the host's launch
time, not the device, sets the step's length. At start-up the model's forward is captured once
per batch size in the capture list, reading its inputs from persistent buffers (DecodeInputs,
gpu_worker/decode_inputs.py); a decode step of B requests writes its inputs straight into those
buffers (InputPreparer) and replays the graph of the smallest captured size >= B. Mixed and
prefill steps run eagerly.

Attention's split-context decode (kernels/triton/paged_decode.py) picks its grid from the longest
context, a host value; a graph is captured with the grid of max_model_len, whose partitions past
a sequence's length return at once, so sizes that split get a second graph for long contexts.
All graphs share one memory pool, captured largest first so smaller ones reuse its blocks.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.forward_context import StepAttention, forward_context

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The captured graphs, by (size, whether attention splits the context), and their
    outputs (hidden states [size, hidden] in the shared pool).

    Handed what capture and replay read: the model's forward (token ids, positions -> hidden
    states), the attention backend, the persistent input buffers, the KV heads per rank, the
    longest context, and the device."""

    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        backend: AttentionBackend[Any],
        inputs: DecodeInputs,
        num_kv_heads: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.inputs = inputs
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.device = device
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0
        # size -> its metadata, whose max_seq_len _splits sets to ask the backend.
        self._probes = {size: inputs.metadata(size, 0) for size in inputs.sizes}

    def _splits(self, size: int, max_seq_len: int) -> bool:
        """Whether attention splits the context of a size-row decode step (host values)."""
        probe = self._probes[size]
        probe.max_seq_len = max_seq_len
        return bool(self.backend.uses_split_decode(probe, self.num_kv_heads, self.device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, with and without the split-context attention
        where a long context would split; logs the time and the memory the graphs hold."""
        model, device = self.model, self.device
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
                step = StepAttention(self.backend, self.backend.graph_metadata(meta, device))
                with forward_context(step):
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
