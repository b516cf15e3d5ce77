"""Paged attention in vectorized PyTorch: the CPU backend.

A step's requests are split into two groups, decodes (one query token) and prefill chunks
(several), so a long chunk does not pad every decode to its length. Each group gathers its
requests' K/V from the paged cache with one index per layer and runs one batched
scaled_dot_product_attention; the gather indices and masks are built once per step.
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
class _Group:
    src_tokens: torch.Tensor | None  # [Bg*Lq] packed token per padded query row (None: identity)
    kv_slots: torch.Tensor  # [Bg, Lkv] cache slots of each request's context
    mask: torch.Tensor | None  # [Bg, 1, Lq, Lkv] True where attention is allowed
    num_queries: int  # Lq
    real_rows: torch.Tensor | None  # padded rows that hold real tokens (None: all)
    dst_tokens: torch.Tensor | None  # packed token index of each real row


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


def _build_group(step: StepBatch, rows: np.ndarray, device: torch.device) -> _Group:
    q_start = step.query_start_loc[rows].astype(np.int64)
    q_lens = step.query_lens[rows].astype(np.int64)
    seq_lens = step.seq_lens[rows].astype(np.int64)
    lq, lkv = int(q_lens.max()), int(seq_lens.max())
    kv_pos = np.arange(lkv)[None, :]
    kv_slots = _positions_to_slots(
        step.block_table[rows], np.minimum(kv_pos, seq_lens[:, None] - 1), step.block_size
    )
    j = np.arange(lq)[None, :]
    real = j < q_lens[:, None]  # [Bg, Lq]
    q_pos = seq_lens[:, None] - q_lens[:, None] + j  # absolute position of each query row
    allowed = kv_pos[:, None, :] <= q_pos[:, :, None]  # causal, also hides kv beyond seq_len
    allowed |= ~real[:, :, None] & (kv_pos[:, None, :] == 0)  # padded rows: any finite row
    src = np.where(real, q_start[:, None] + j, q_start[:, None]).reshape(-1)
    all_real = bool(real.all())
    identity = (
        all_real
        and len(rows) == step.query_lens.shape[0]
        and np.array_equal(src, np.arange(src.shape[0]))
    )
    needs_mask = not (lq == 1 and bool((seq_lens == lkv).all()))

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return _Group(
        src_tokens=None if identity else dev(src),
        kv_slots=dev(kv_slots),
        mask=dev(allowed[:, None]) if needs_mask else None,
        num_queries=lq,
        real_rows=None if all_real else dev(np.flatnonzero(real.reshape(-1))),
        dst_tokens=None if identity else dev(src[real.reshape(-1)]),
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
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; writes k/v into the cache, returns [T, Hq, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].src_tokens is None:
            return self._attend(q, key_cache, value_cache, meta.groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.groups:
            rows = self._attend(q, key_cache, value_cache, group, scale)
            if group.real_rows is not None:
                rows = rows.index_select(0, group.real_rows)
            out.index_copy_(0, group.dst_tokens, rows)
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: _Group,
        scale: float,
    ) -> torch.Tensor:
        # index_select: advanced indexing costs ~10x more per call on CPU.
        qg = q if group.src_tokens is None else q.index_select(0, group.src_tokens)
        bg, lq = group.kv_slots.shape[0], group.num_queries
        qg = qg.view(bg, lq, q.shape[1], q.shape[2]).transpose(1, 2)
        slots = group.kv_slots.view(-1)
        kv_shape = (bg, -1, key_cache.shape[1], key_cache.shape[2])
        keys = key_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)  # [Bg, Hkv, Lkv, D]
        values = value_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(bg * lq, q.shape[1], q.shape[2])
