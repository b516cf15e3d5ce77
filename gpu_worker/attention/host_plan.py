"""A step's attention plan built on the host, shared by the backends that plan there (torch,
mla_torch).

The step's requests are split into two groups, decodes (one query token) and prefill chunks
(several), so a long chunk does not pad every decode to its length. Each group pads its
requests to the group's longest query and gathers their keys from the paged cache by slot; the
gather indices, causal masks and the packed<->padded row maps are built once a step on the host
and read by every layer. A sliding window's keys are planned at the step's first layer with
that window (the gather starts at the oldest position a request's queries still see, so keys
before it are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention.metadata import StepBatch


@dataclass(slots=True)
class KeyView:
    """The keys a group's queries read: cache slots and where attention is allowed."""

    kv_slots: torch.Tensor  # [Bg, Lkv] cache slots of the keys each request's queries may see
    mask: torch.Tensor | None  # [Bg, 1, Lq, Lkv] True where attention is allowed (None: all)


@dataclass(slots=True)
class _HostRows:
    """A group's host arrays, kept to build a sliding window's view when a layer asks."""

    block_table: np.ndarray  # [Bg, max_blocks]
    seq_lens: np.ndarray  # [Bg]
    q_pos: np.ndarray  # [Bg, Lq] absolute position of each (possibly padded) query row
    real: np.ndarray  # [Bg, Lq] rows that hold real tokens
    block_size: int


@dataclass(slots=True)
class Group:
    """Requests attended together, each padded to the group's longest query."""

    src_tokens: torch.Tensor | None  # [Bg*Lq] packed token per padded query row (None: identity)
    num_queries: int  # Lq
    real_rows: torch.Tensor | None  # padded rows that hold real tokens (None: all)
    dst_tokens: torch.Tensor | None  # packed token index of each real row (None: identity)
    host: _HostRows
    device: torch.device
    # By sliding window (None: the whole context); the whole context's is built with the step.
    views: dict[int | None, KeyView]

    def view(self, sliding_window: int | None = None) -> KeyView:
        """The keys for a layer with this window, built at the step's first such layer."""
        view = self.views.get(sliding_window)
        if view is None:
            assert sliding_window is not None  # the whole context's view is built with the step
            if int(self.host.seq_lens.max()) <= sliding_window:
                view = self.views[None]  # every key is within every query's window
            else:
                view = _key_view(self.host, self.device, sliding_window)
            self.views[sliding_window] = view
        return view

    def scatter(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the group's padded output rows [Bg*Lq, ...] to their packed tokens of out."""
        if self.real_rows is not None:
            rows = rows.index_select(0, self.real_rows)
        assert self.dst_tokens is not None  # identity only for a step's one whole group
        out.index_copy_(0, self.dst_tokens, rows)


def plan_step(step: StepBatch, device: torch.device) -> list[Group]:
    """The step's groups, decodes first then prefill chunks (only those with requests). A step
    whose one group is its packed tokens as they are has src_tokens None (no gather/scatter)."""
    q_lens = step.query_lens
    return [
        _plan_group(step, rows, device)
        for rows in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1))
        if len(rows)
    ]


def is_whole(groups: list[Group]) -> bool:
    """Whether the step is one group whose padded rows are the packed tokens themselves."""
    return len(groups) == 1 and groups[0].src_tokens is None


def _positions_to_slots(
    block_table: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    rows = np.arange(block_table.shape[0])[:, None]
    return (
        block_table[rows, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )


def _key_view(host: _HostRows, device: torch.device, sliding_window: int | None) -> KeyView:
    """Slots and mask of the keys the rows see: from position 0, or with a window from the
    first position the request's first query still sees (a query at p sees p - window + 1 ..
    p), up to the request's last token; positions past it repeat the last slot, masked."""
    seq_lens, q_pos, real = host.seq_lens, host.q_pos, host.real
    first = np.zeros_like(seq_lens)
    if sliding_window is not None:
        first = np.maximum(q_pos[:, 0] - sliding_window + 1, 0)
    lkv = int((seq_lens - first).max())
    kv_pos = first[:, None] + np.arange(lkv)[None, :]  # [Bg, Lkv]
    kv_slots = _positions_to_slots(
        host.block_table, np.minimum(kv_pos, seq_lens[:, None] - 1), host.block_size
    )
    # Causal, which also hides the repeated slots past seq_len.
    allowed = kv_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        allowed &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    allowed |= ~real[:, :, None] & (np.arange(lkv) == 0)  # padded rows: any finite row
    needs_mask = not (
        q_pos.shape[1] == 1 and bool((seq_lens - first == lkv).all()) and sliding_window is None
    )
    return KeyView(
        kv_slots=_to(kv_slots, device), mask=_to(allowed[:, None], device) if needs_mask else None
    )


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _plan_group(step: StepBatch, rows: np.ndarray, device: torch.device) -> Group:
    """The row maps of the requests `rows` of the step, and their whole-context key view."""
    q_start = step.query_start_loc[rows].astype(np.int64)
    q_lens = step.query_lens[rows].astype(np.int64)
    seq_lens = step.seq_lens[rows].astype(np.int64)
    lq = int(q_lens.max())
    j = np.arange(lq)[None, :]
    real = j < q_lens[:, None]  # [Bg, Lq]
    q_pos = seq_lens[:, None] - q_lens[:, None] + j  # absolute position of each query row
    src = np.where(real, q_start[:, None] + j, q_start[:, None]).reshape(-1)
    all_real = bool(real.all())
    identity = (
        all_real
        and len(rows) == step.query_lens.shape[0]
        and np.array_equal(src, np.arange(src.shape[0]))
    )
    host = _HostRows(step.block_table[rows], seq_lens, q_pos, real, step.block_size)
    return Group(
        src_tokens=None if identity else _to(src, device),
        num_queries=lq,
        real_rows=None if all_real else _to(np.flatnonzero(real.reshape(-1)), device),
        dst_tokens=None if identity else _to(src[real.reshape(-1)], device),
        host=host,
        device=device,
        views={None: _key_view(host, device, None)},
    )
