"""A drafter's forward inputs, gathered over the runner's token table and block tables.

A proposer that runs a model of its own (a draft model, an EAGLE head) keeps its own count of
computed positions per slot (those whose KV its cache holds), and its cache sits in the target's
block ids. A forward of it computes, for each request i, query_lens[i] tokens of slot slots[i]
from position start[i]: the token ids come from the runner's token table (RequestStates.token_ids,
where the proposer writes its own drafts past a request's known tokens), the KV slots from the
runner's block table. The same gather as the target's step (kernels.prepare_inputs: one host copy,
one kernel), over the proposer's positions instead of the runner's computed counts.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.input_batch import InputBatch
from gpu_worker.request_state import RequestStates
from gpu_worker.staging import HostToDevice
from kernels.prepare_inputs import prepare_inputs_for


class DraftInputs:
    """Builds a drafter's InputBatches with one host-to-device copy and one kernel each."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.h2d = HostToDevice(device)
        self._gather = prepare_inputs_for(device)
        # [max_num_reqs] int64: each slot's first position in the forward being prepared (the
        # gather's num_computed), written for the forward's slots only.
        self._start = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # Set once the drafter's CUDA graphs are captured (use_graph_inputs).
        self._graph_inputs: DecodeInputs | None = None

    def use_graph_inputs(self, inputs: DecodeInputs) -> None:
        """From now on, forwards of one token per request that a captured size covers gather
        their inputs into the drafter's graph buffers (InputBatch.in_graph_buffers)."""
        self._graph_inputs = inputs

    def prepare(
        self,
        states: RequestStates,
        slots_np: np.ndarray,
        start_np: np.ndarray,
        query_lens_np: np.ndarray,
        sample_rows_np: np.ndarray,
    ) -> InputBatch:
        """Inputs computing query_lens_np[i] (>= 1) tokens of slot slots_np[i] from position
        start_np[i]; the rows of sample_rows_np read the hidden state of their last token
        (InputBatch.logits_indices). Nothing is read back from the device."""
        num_reqs = len(slots_np)
        # Fresh arrays: on the CPU the device tensors share their memory (HostToDevice.copy).
        slots_np = np.array(slots_np, dtype=np.int64)
        start_np = np.array(start_np, dtype=np.int64)
        sample_rows_np = np.array(sample_rows_np, dtype=np.int64)
        qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens_np, out=qsl_np[1:])
        num_tokens = int(qsl_np[-1])
        seq_lens_np = (start_np + query_lens_np).astype(np.int32)
        max_seq_len = int(seq_lens_np.max()) if num_reqs else 0
        max_blocks = -(-max_seq_len // states.block_size)
        max_query_len = int(query_lens_np.max()) if num_reqs else 0
        graph = self._graph_inputs
        out = None
        in_graph_buffers = (
            graph is not None and max_query_len == 1 and graph.padded_size(num_reqs) > 0
        )
        if in_graph_buffers:
            assert graph is not None
            max_blocks = graph.max_blocks  # a graph reads whole block-table rows
            out = graph.outputs(num_reqs, len(sample_rows_np))
        slots, start, qsl, sample_rows = self.h2d.copy(slots_np, start_np, qsl_np, sample_rows_np)
        self._start.index_copy_(0, slots, start)
        inputs = self._gather(
            slots,
            qsl,
            sample_rows,
            self._start,
            states.token_ids,
            states.block_table,
            states.block_size,
            num_tokens,
            max_blocks,
            out,
        )
        device_batch = DeviceBatch(
            query_start_loc=qsl,
            seq_lens=inputs.seq_lens,
            block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        return InputBatch(
            req_ids=[],
            slots_np=slots_np,
            query_start_loc_np=qsl_np,
            seq_lens_np=seq_lens_np,
            sample_rows_np=sample_rows_np,
            sample_slots_np=slots_np[sample_rows_np],
            slots=slots,
            sample_slots=inputs.sample_slots,
            logits_indices=inputs.logits_indices,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            device_batch=device_batch,
            slot_block_table_np=states.block_table_np,
            max_blocks=max_blocks,
            block_size=states.block_size,
            in_graph_buffers=in_graph_buffers,
        )
