"""Sampling metadata for a verification step: one row per position a request verifies.

Request i of the step verifies num_drafts[i] drafts in num_drafts[i] + 1 consecutive rows: row j
holds the target's logits after the request's tokens and its first j drafts. Sampling row j must
be what the plain sampler would do there had drafts 1..j been sampled: the request's parameters
repeated on every row, its penalty counts and min-tokens progress advanced by the j drafts
before the row. The rows are gathered by slot through SamplingStates.metadata (each row's slot
repeated), then the counts and min-tokens bans are moved on by the drafts.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.bad_words import TokenHistory
from gpu_worker.sampling_metadata import SamplingMetadata
from gpu_worker.sampling_state import _MIN_TOKENS, _NUM_BAN, SamplingStates


class _RowLayout:
    """Where each verification row sits, on the host: T = S + num_drafts.sum() rows."""

    def __init__(self, num_drafts_np: np.ndarray) -> None:
        num_rows = num_drafts_np.astype(np.int64) + 1
        self.num_rows = int(num_rows.sum())  # T
        self.request_np = np.repeat(np.arange(len(num_rows)), num_rows)  # [T]
        starts = np.cumsum(num_rows) - num_rows
        self.start_np = starts[self.request_np]  # [T]: the request's first row
        self.offset_np = np.arange(self.num_rows) - self.start_np  # [T]: drafts before the row

    def draft_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, dest) row pairs, one per draft before each row: the draft that source
        verifies was sampled before dest's position (source < dest, same request)."""
        offsets = self.offset_np
        dest = np.repeat(np.arange(self.num_rows), offsets)
        first = np.repeat(np.cumsum(offsets) - offsets, offsets)
        source = np.repeat(self.start_np, offsets) + np.arange(len(dest)) - first
        return source, dest


def expand_metadata(
    states: SamplingStates,
    slots_np: np.ndarray,
    slots: torch.Tensor,
    num_drafts_np: np.ndarray,
    draft_token_ids: torch.Tensor,
    history: TokenHistory | None,
) -> SamplingMetadata:
    """Metadata for the T verification rows of the S requests in slots (row i = slot
    slots_np[i]), request i verifying num_drafts_np[i] drafts; draft_token_ids [T] holds the draft
    each row verifies (-1 on each request's last row). Row j of a request samples as the plain
    sampler would after drafts 1..j; without drafts this is states.metadata(slots_np, slots,
    history). Requests with bad words must come without drafts (their words are matched against
    the tokens known before the step)."""
    if not num_drafts_np.any():
        return states.metadata(slots_np, slots, history)
    if states.bad_words and history is not None:
        with_words = np.isin(slots_np, np.fromiter(states.bad_words, dtype=np.int64))
        if num_drafts_np[with_words].any():
            raise ValueError("a request with bad words cannot verify drafts")
    rows = _RowLayout(num_drafts_np)
    row_slots_np = slots_np[rows.request_np]
    arrays = [np.ascontiguousarray(row_slots_np, dtype=np.int64), rows.offset_np]
    if states.output_counts is not None and states.penalized_np[slots_np].any():
        # Only penalized rows keep counts (the others' are never read).
        source, dest = rows.draft_pairs()
        counted = states.penalized_np[row_slots_np[dest]]
        arrays += [source[counted], dest[counted]]
    on_device = states.h2d.copy(*arrays)
    row_slots, offsets = on_device[0], on_device[1]

    md = states.metadata(row_slots_np, row_slots, history)
    if md.output_counts is not None:
        sources, dests = on_device[2], on_device[3]
        md.output_counts.index_put_(
            (dests, draft_token_ids.index_select(0, sources)),
            torch.ones(dests.shape, device=md.output_counts.device),
            accumulate=True,
        )
    if md.min_tokens_mask is not None:
        # The host mirrors first: rows whose drafts already reach min_tokens drop the ban.
        ints_np = states.ints_np[row_slots_np]
        num_output_np = states.num_output_np[row_slots_np] + rows.offset_np
        if ((num_output_np < ints_np[:, _MIN_TOKENS]) & (ints_np[:, _NUM_BAN] > 0)).any():
            below, banned = md.min_tokens_mask
            num_output = states.num_output.index_select(0, row_slots) + offsets
            min_tokens = states.ints.index_select(0, row_slots)[:, _MIN_TOKENS]
            md.min_tokens_mask = (below & (num_output < min_tokens), banned)
        else:
            md.min_tokens_mask = None
    return md
