"""Paged attention in vectorized PyTorch: the CPU backend.

A step's requests are split into two groups, decodes (one query token) and prefill chunks
(several), so a long chunk does not pad every decode to its length. Each group gathers its
requests' K/V from the paged cache with one index per layer and runs one batched
scaled_dot_product_attention; the gather indices and masks are built once per step, those of
a sliding window at its first layer of the step (a window's gather starts at the oldest position
a request's queries still see, so keys before it are never read). Sinks add one logit per head
to the softmax's denominator, which scaled_dot_product_attention cannot: such layers run the
softmax themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import DeviceBatch, StepBatch


@dataclass(slots=True)
class _KeyView:
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
class _Group:
    src_tokens: torch.Tensor | None  # [Bg*Lq] packed token per padded query row (None: identity)
    num_queries: int  # Lq
    real_rows: torch.Tensor | None  # padded rows that hold real tokens (None: all)
    dst_tokens: torch.Tensor | None  # packed token index of each real row
    host: _HostRows
    device: torch.device
    # By sliding window (None: the whole context); the whole context's is built with the step.
    views: dict[int | None, _KeyView]

    def view(self, sliding_window: int | None) -> _KeyView:
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


@dataclass(slots=True)
class TorchAttnMetadata:
    """Per-step metadata of the torch backend."""

    slot_mapping: torch.Tensor
    groups: list[_Group]
    num_tokens: int


def _positions_to_slots(
    block_table: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    rows = np.arange(block_table.shape[0])[:, None]
    return (
        block_table[rows, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )


def _key_view(host: _HostRows, device: torch.device, sliding_window: int | None) -> _KeyView:
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
    return _KeyView(
        kv_slots=_to(kv_slots, device), mask=_to(allowed[:, None], device) if needs_mask else None
    )


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _build_group(step: StepBatch, rows: np.ndarray, device: torch.device) -> _Group:
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
    return _Group(
        src_tokens=None if identity else _to(src, device),
        num_queries=lq,
        real_rows=None if all_real else _to(np.flatnonzero(real.reshape(-1)), device),
        dst_tokens=None if identity else _to(src[real.reshape(-1)], device),
        host=host,
        device=device,
        views={None: _key_view(host, device, None)},
    )


class TorchAttentionBackend(AttentionBackend[TorchAttnMetadata]):
    """Mixed prefill/decode attention over the paged KV cache with plain torch ops."""

    name = "torch"
    support = attention_support(name)
    plans_on_host = True  # build() reads the step's host arrays (StepBatch)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The kernels' layout, [2, num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> TorchAttnMetadata:
        """Precompute gather indices and masks for the whole step."""
        assert step is not None, "plans_on_host: the runner hands in the host arrays"
        q_lens = step.query_lens
        groups = []
        for rows in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)):
            if len(rows):
                groups.append(_build_group(step, rows, device))
        return TorchAttnMetadata(device_batch.slot_mapping, groups, int(step.query_start_loc[-1]))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttnMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; writes k/v into the cache, returns [T, Hq, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].src_tokens is None:
            group = meta.groups[0]
            return self._attend(
                q, key_cache, value_cache, group, group.view(sliding_window), scale, sinks
            )
        out = torch.empty_like(q)
        for group in meta.groups:
            view = group.view(sliding_window)
            rows = self._attend(q, key_cache, value_cache, group, view, scale, sinks)
            if group.real_rows is not None:
                rows = rows.index_select(0, group.real_rows)
            assert group.dst_tokens is not None  # identity only for a step's one whole group
            out.index_copy_(0, group.dst_tokens, rows)
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: _Group,
        view: _KeyView,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        # index_select: advanced indexing costs ~10x more per call on CPU.
        qg = q if group.src_tokens is None else q.index_select(0, group.src_tokens)
        bg, lq = view.kv_slots.shape[0], group.num_queries
        qg = qg.view(bg, lq, q.shape[1], q.shape[2]).transpose(1, 2)
        slots = view.kv_slots.view(-1)
        kv_shape = (bg, -1, key_cache.shape[1], key_cache.shape[2])
        keys = key_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)  # [Bg, Hkv, Lkv, D]
        values = value_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)
        if sinks is None:
            out = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=view.mask, scale=scale, enable_gqa=True
            )
        else:
            out = _attend_with_sinks(qg, keys, values, view.mask, scale, sinks)
        return out.transpose(1, 2).reshape(bg * lq, q.shape[1], q.shape[2])


def _attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of q [Bg, Hq, Lq, D] over keys/values [Bg, Hkv, Lkv, D] whose softmax also counts
    exp(sinks[h]) in each row's denominator (transformers' gpt-oss eager attention): [Bg, Hq,
    Lq, D]."""
    bg, hq, lq, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(bg, hkv, hq // hkv * lq, d)  # a kv head's query heads, one after another
    scores = torch.matmul(qg, keys.transpose(2, 3)).view(bg, hq, lq, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, hq, 1, 1).expand(bg, hq, lq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(bg, hkv, hq // hkv * lq, -1), values)
    return out.view(bg, hq, lq, d)
