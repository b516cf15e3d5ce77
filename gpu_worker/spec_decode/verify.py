"""A speculative step in the model runner: the scheduled drafts written into the token table,
the rows the target verifies, and the verified tokens applied to the request state.

A request verifying k drafts computes k + 1 tokens this step (its newest known token, then the
drafts, which the runner wrote after its known tokens), and the step samples at all k + 1
positions: verification rows, grouped per request, in the step's order of sampling requests.
Rejection sampling keeps m of them (1 <= m <= k + 1: the accepted drafts and one more token);
the request then knows m more tokens and the KV of m more positions is valid (the rejected
drafts' KV lies beyond num_computed and is overwritten by the next step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.input_batch import InputBatch
from gpu_worker.request_state import RequestStates
from gpu_worker.sampling_state import SamplingStates
from gpu_worker.staging import HostToDevice


@dataclass(slots=True)
class VerifyRows:
    """The verification rows of a step's sampling requests (S of them, T rows in all)."""

    num_drafts_np: np.ndarray  # [S] int64: drafts each verifies
    row_starts_np: np.ndarray  # [S] int64: its first row
    logits_indices: torch.Tensor  # [T] int64: the token row of the step's hidden states
    draft_token_ids: torch.Tensor  # [T] int64: the draft each row verifies; -1: bonus row

    @property
    def num_rows(self) -> int:
        return int(self.logits_indices.shape[0])


def stage_drafts(states: RequestStates, spec: dict[str, list[int]]) -> np.ndarray:
    """Write each request's scheduled drafts after its known tokens (staged, applied with the
    step's other writes); returns the drafts per slot [R] (0 for slots without)."""
    per_slot = np.zeros(states.max_num_reqs, dtype=np.int64)
    for req_id, drafts in spec.items():
        if drafts:
            slot = states.slot_of[req_id]
            states.stage_tokens(slot, drafts, int(states.num_tokens_np[slot]))
            per_slot[slot] = len(drafts)
    return per_slot


def verify_rows(batch: InputBatch, drafts_per_slot: np.ndarray, h2d: HostToDevice) -> VerifyRows:
    """The rows to verify: each sampling request's last 1 + k token rows, and the draft each
    row checks (the input token after it)."""
    sample_rows = batch.sample_rows_np
    k = drafts_per_slot[batch.sample_slots_np]
    counts = k + 1
    ends = batch.query_start_loc_np[sample_rows + 1].astype(np.int64)
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(total, dtype=np.int64) - starts[owner]
    token_rows = ends[owner] - counts[owner] + within
    bonus = within == k[owner]
    next_rows = np.where(bonus, token_rows, token_rows + 1)
    rows, nxt, is_bonus = h2d.copy(token_rows, next_rows, bonus)
    drafts = batch.input_ids.index_select(0, nxt).masked_fill(is_bonus, -1)
    return VerifyRows(k, starts, rows, drafts)


@dataclass(slots=True)
class OneTokenRows:
    """A speculative step as attention sees it (one_token_rows): the host plan (for a backend
    that plans on the host), the device batch, and each row's slot [rows] int64."""

    host: StepBatch | None
    device: DeviceBatch
    row_slots: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.device.seq_lens.shape[0])


def one_token_rows(
    batch: InputBatch, drafts_per_slot: np.ndarray, h2d: HostToDevice, plans_on_host: bool
) -> OneTokenRows:
    """The step's attention batch with each drafting request's 1 + k tokens as 1 + k rows of
    one token (row j: the request's block table, context up to its position j), other requests
    unchanged. Attention computes the same (a query attends to its sequence's positions up to
    its own, whichever row it sits in; every row's key and value is written before any is
    read), but the step is now a decode-shaped batch: the CPU's fused decode stack takes it,
    and decode kernels (and CUDA graphs, write_graph_inputs) serve it."""
    qsl, seq_lens = batch.query_start_loc_np, batch.seq_lens_np
    n = np.diff(qsl).astype(np.int64)
    flat = drafts_per_slot[batch.slots_np] > 0
    rows_per_req = np.where(flat, n, 1)
    row_req = np.repeat(np.arange(len(n)), rows_per_req)
    row_len = np.where(flat[row_req], 1, n[row_req])
    new_qsl = np.zeros(len(row_req) + 1, dtype=np.int32)
    np.cumsum(row_len, out=new_qsl[1:])
    within = np.arange(len(row_req)) - (np.cumsum(rows_per_req) - rows_per_req)[row_req]
    row_seq = np.where(
        flat[row_req], seq_lens[row_req] - n[row_req] + 1 + within, seq_lens[row_req]
    ).astype(np.int32)
    qsl_t, seq_t, req_t = h2d.copy(new_qsl, row_seq, row_req)
    step = batch.device_batch
    device = DeviceBatch(
        query_start_loc=qsl_t,
        seq_lens=seq_t,
        block_table=step.block_table.index_select(0, req_t),
        slot_mapping=step.slot_mapping,
        max_query_len=int(row_len.max()),
        max_seq_len=step.max_seq_len,
    )
    host = None
    if plans_on_host:
        planned = batch.host_batch()
        host = StepBatch(
            new_qsl, row_seq, planned.block_table[row_req], planned.slot_mapping, batch.block_size
        )
    return OneTokenRows(host, device, batch.slots.index_select(0, req_t))


def write_graph_inputs(
    inputs: DecodeInputs, batch: InputBatch, rows: OneTokenRows, block_table: torch.Tensor
) -> None:
    """Write a speculative step whose every row is one token into the decode graphs'
    persistent buffers (its first rows.num_rows rows; full-width block-table rows), as
    InputPreparer does for a decode step, so the graph of that many rows replays it."""
    n = rows.num_rows
    inputs.input_ids[:n].copy_(batch.input_ids)
    inputs.positions[:n].copy_(batch.positions)
    inputs.seq_lens[:n].copy_(rows.device.seq_lens)
    inputs.slot_mapping[:n].copy_(rows.device.slot_mapping)
    inputs.block_table[:n].copy_(block_table.index_select(0, rows.row_slots))


def apply_verified(
    states: RequestStates,
    sampling: SamplingStates,
    slots: torch.Tensor,
    slots_np: np.ndarray,
    num_drafts_np: np.ndarray,
    output_token_ids: torch.Tensor,
    num_output: torch.Tensor,
) -> np.ndarray:
    """After the step's post-update (every request's num_computed at its seq_len, no token
    appended): the sampling requests (slots) keep num_output[i] of output_token_ids[i] ([S,
    K + 1], -1 padded): their tokens appended, computed counts rolled back over the rejected
    drafts, output counts (min_tokens, penalties) advanced. Returns num_output on the host (the
    one read of the device in a speculative step: the next step's host mirrors need it)."""
    device = slots.device
    k = torch.from_numpy(num_drafts_np).to(device, non_blocking=True)
    states.num_computed.index_add_(0, slots, num_output - k - 1)
    width = output_token_ids.shape[1]
    # Column j < m writes output j at num_tokens + j; the rest repeat column m - 1 (same index,
    # same value), so no write lands past the request's last token or collides with another.
    cols = torch.minimum(
        torch.arange(width, device=device).unsqueeze(0), (num_output - 1).unsqueeze(1)
    )
    values = output_token_ids.gather(1, cols)
    base = slots * states.token_ids.stride(0) + states.num_tokens.index_select(0, slots)
    states.token_ids.view(-1).index_copy_(
        0, (base.unsqueeze(1) + cols).reshape(-1), values.reshape(-1)
    )
    states.num_tokens.index_add_(0, slots, num_output)
    sampling.num_output.index_add_(0, slots, num_output)
    if sampling.output_counts is not None and sampling.penalized_np[slots_np].any():
        valid = torch.arange(width, device=device).unsqueeze(0) < num_output.unsqueeze(1)
        sampling.output_counts.index_put_(
            (slots.unsqueeze(1).expand_as(values), values),
            valid.to(torch.float32),
            accumulate=True,
        )
    m = num_output.cpu().numpy()
    states.num_computed_np[slots_np] += m - num_drafts_np - 1
    states.num_tokens_np[slots_np] += m
    sampling.num_output_np[slots_np] += m
    return m
