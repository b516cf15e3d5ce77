"""Paged attention through the Triton kernels in kernels/ (the CUDA backend)."""

from __future__ import annotations

import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from kernels.paged_attention import paged_attention
from kernels.write_kv import write_kv


class TritonAttentionBackend:
    """Writes K/V by slot mapping and runs mixed prefill/decode attention over block tables."""

    name = "triton"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """The kernels' layout: [2, num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(self, step: StepBatch, device_batch: DeviceBatch, device: torch.device) -> DeviceBatch:
        """The kernels read the device batch directly."""
        return device_batch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: DeviceBatch, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]."""
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return paged_attention(q, kv_cache[0], kv_cache[1], meta.block_table, meta.query_start_loc,
                               meta.seq_lens, scale, max_query_len=meta.max_query_len)
