"""One step's inputs, built on the device from the persistent request state.

The host computes only what it knows without the device (which slots run, how many tokens each,
which of them sample) and sends those few arrays in one copy; input ids, positions, sequence
lengths, slot mapping and block tables are then gathered on the device. A decode's input id is
the token the last step sampled, which the post-update wrote into the device's token table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.request_state import RequestStates
from gpu_worker.staging import HostToDevice
from kernels.prepare_inputs import PreparedInputs, empty_outputs, prepare_inputs_for


@dataclass(slots=True)
class InputBatch:
    """A step's inputs: host arrays in the order of req_ids, and their device counterparts."""

    req_ids: list[str]
    slots_np: np.ndarray  # [B] int64
    query_start_loc_np: np.ndarray  # [B+1] int32
    seq_lens_np: np.ndarray  # [B] int32
    sample_rows_np: np.ndarray  # [S] int64: rows of req_ids that sample
    sample_slots_np: np.ndarray  # [S] int64: their slots
    slots: torch.Tensor  # [B] int64
    sample_slots: torch.Tensor  # [S] int64
    logits_indices: torch.Tensor  # [S] int64: the token row each sample reads
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    device_batch: DeviceBatch
    # The runner's host mirror of every slot's block table [max_num_reqs, W] int32, read at
    # this step (block_table_np gathers the step's rows, for host-side backends only).
    slot_block_table_np: np.ndarray
    max_blocks: int
    block_size: int
    # The step's inputs sit in the CUDA graphs' buffers (a decode step that one can replay).
    in_graph_buffers: bool = False

    @property
    def block_table_np(self) -> np.ndarray:
        """[B, max_blocks] int32: the step's rows of the host mirror (valid during the step)."""
        return self.slot_block_table_np[self.slots_np, : self.max_blocks]

    def host_batch(self) -> StepBatch:
        """The step as host arrays, for an attention backend that plans on the host."""
        qsl, seq_lens, bs = self.query_start_loc_np, self.seq_lens_np, self.block_size
        block_table = self.block_table_np
        token_req = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))
        positions = (seq_lens - np.diff(qsl))[token_req] + (np.arange(qsl[-1]) - qsl[token_req])
        slot_mapping = (
            block_table[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        )
        return StepBatch(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            block_size=bs,
        )


class InputPreparer:
    """Builds InputBatches from RequestStates with one host-to-device copy and one kernel per
    step (kernels.prepare_inputs)."""

    def __init__(self, states: RequestStates, h2d: HostToDevice, device: torch.device) -> None:
        self.states = states
        self.h2d = h2d
        self.device = device
        self._gather = prepare_inputs_for(device)
        # The last step's (states.version, req_ids, slots): most steps run the same requests.
        self._last_slots: tuple[int, list[str], np.ndarray] = (-1, [], np.zeros(0, np.int64))
        # B -> (arange(B + 1) int32, arange(B) int64): the query start locations and sampling
        # rows of a step of B single-token requests that all sample (a decode step). The same
        # objects each step, never written: on the CPU the copy of an array it copied last
        # time is free (HostToDevice.copy).
        self._decode_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # On the CPU: the last step's gathered inputs, (B, T, max_blocks, S) -> tensors, filled
        # again by the next step of that shape instead of seven new tensors (a steady decode
        # keeps its shape for block_size steps). Nothing reads a step's inputs once the next
        # step's are prepared: execute_model_async uses them before it returns. On CUDA the
        # caching allocator makes new ones cheap and they stay per step.
        self._reuse_out = device.type == "cpu"
        self._out: tuple[tuple[int, int, int, int], PreparedInputs] | None = None
        # Set once CUDA graphs are captured (use_graph_inputs).
        self._graph_inputs: DecodeInputs | None = None

    def use_graph_inputs(self, inputs: DecodeInputs) -> None:
        """From now on, decode steps the CUDA graphs cover write their inputs into the graphs'
        persistent buffers (gpu_worker/decode_inputs.py); the one way to hand them in, called
        once the graphs are captured (earlier steps, warm-up's included, run eagerly)."""
        self._graph_inputs = inputs

    def _slots(self, req_ids: list[str]) -> np.ndarray:
        version, last_ids, last_slots = self._last_slots
        if version == self.states.version and req_ids == last_ids:
            return last_slots
        slot_of = self.states.slot_of
        slots = np.array([slot_of[r] for r in req_ids], dtype=np.int64)
        self._last_slots = (self.states.version, req_ids, slots)
        return slots

    def _decode(self, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
        arrays = self._decode_arrays.get(num_reqs)
        if arrays is None:
            arrays = self._decode_arrays[num_reqs] = (
                np.arange(num_reqs + 1, dtype=np.int32),
                np.arange(num_reqs, dtype=np.int64),
            )
        return arrays

    def prepare(
        self, req_ids: list[str], num_scheduled: np.ndarray, num_tokens: int | None = None
    ) -> InputBatch:
        """Inputs for a step computing num_scheduled[i] tokens of request req_ids[i]
        (num_tokens: their sum, when the caller knows it)."""
        st = self.states
        num_reqs = len(req_ids)
        slots_np = self._slots(req_ids)
        seq_lens_np = (st.num_computed_np[slots_np] + num_scheduled).astype(np.int32)
        sample_rows_np = np.flatnonzero(seq_lens_np >= st.num_tokens_np[slots_np])
        if num_tokens == num_reqs and num_reqs:
            # One token each (every count is at least one): the query start locations are
            # 0..B, and when every request samples, so are the sampling rows.
            qsl_np, iota = self._decode(num_reqs)
            max_query_len = 1
            if len(sample_rows_np) == num_reqs:
                sample_rows_np = iota
        else:
            qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
            np.cumsum(num_scheduled, out=qsl_np[1:])
            num_tokens = int(qsl_np[-1])
            max_query_len = int(num_scheduled.max()) if num_reqs else 0
        max_seq_len = int(seq_lens_np.max()) if num_reqs else 0
        max_blocks = -(-max_seq_len // st.block_size)

        slots, qsl, sample_rows = self.h2d.copy(slots_np, qsl_np, sample_rows_np)
        out = None
        graph = self._graph_inputs
        in_graph_buffers = (
            graph is not None and max_query_len == 1 and graph.padded_size(num_reqs) > 0
        )
        if in_graph_buffers:
            assert graph is not None
            # Whole block-table rows: a graph reads the buffer at its full width.
            max_blocks = graph.max_blocks
            out = graph.outputs(num_reqs, len(sample_rows_np))
        elif self._reuse_out:
            shape = (num_reqs, num_tokens, max_blocks, len(sample_rows_np))
            last = self._out
            if last is not None and last[0] == shape:
                out = last[1]
            else:
                out = empty_outputs(self.device, *shape)
                self._out = (shape, out)
        inputs = self._gather(
            slots,
            qsl,
            sample_rows,
            st.num_computed,
            st.token_ids,
            st.block_table,
            st.block_size,
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
            req_ids=req_ids,
            slots_np=slots_np,
            query_start_loc_np=qsl_np,
            seq_lens_np=seq_lens_np,
            sample_rows_np=sample_rows_np,
            # Every row samples (sample_rows is 0..B-1): the same array, so that consumers
            # that cache by the sampling slots (SamplingStates.metadata) see the same object.
            sample_slots_np=(
                slots_np if len(sample_rows_np) == num_reqs else slots_np[sample_rows_np]
            ),
            slots=slots,
            sample_slots=inputs.sample_slots,
            logits_indices=inputs.logits_indices,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            device_batch=device_batch,
            slot_block_table_np=st.block_table_np,
            max_blocks=max_blocks,
            block_size=st.block_size,
            in_graph_buffers=in_graph_buffers,
        )
