"""Paged attention through the C kernels (kernels/cpu/): the CPU backend for fp32.

K/V are written into the cache by slot mapping, then one kernel call attends every request of
the step (decodes and prefill chunks alike) straight from its blocks: no gather, no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from kernels.cpu_ops import paged_attention


@dataclass(slots=True)
class CpuAttnMetadata:
    """Per-step metadata: host arrays viewed as tensors (no copies on the CPU)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


class CpuAttentionBackend:
    """Mixed prefill/decode attention over the paged KV cache in one C kernel call per layer."""

    name = "cpu"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """The kernels' layout, [2, num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(self, step: StepBatch, device_batch: DeviceBatch, device: torch.device) -> CpuAttnMetadata:
        return CpuAttnMetadata(device_batch.slot_mapping, device_batch.block_table,
                               device_batch.query_start_loc, device_batch.seq_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: CpuAttnMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; writes k/v into the cache, returns [T, Hq, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        return paged_attention(q, kv_cache[0], kv_cache[1], meta.block_table, meta.query_start_loc,
                               meta.seq_lens, scale)
