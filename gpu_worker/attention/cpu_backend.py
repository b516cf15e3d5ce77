"""Paged attention through the C kernels (kernels/cpu/): the CPU backend for fp32.

K/V are written into the cache by slot mapping, then one kernel call attends every request of
the step (decodes and prefill chunks alike) straight from its blocks: no gather, no padding.
The cache keeps each block's keys transposed per KV head, so the kernel's score loop is plain
vector FMAs (kernels/cpu/paged_attention.c). A layer's sliding window, sinks and logits soft cap
go to the same kernel: the walk starts at the window, the sinks seed each softmax, the cap bends
each score before its softmax step. An fp8 cache (float8_e4m3fn, same layout) is written
quantized by the layer's k_scale / v_scale and converted back to fp32 as the kernel reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from kernels.cpu_binding import available as c_kernels_available
from kernels.paged_attention import paged_attention_cpu
from kernels.write_kv import write_kv_cpu


@dataclass(slots=True)
class CpuAttnMetadata:
    """Per-step metadata: host arrays viewed as tensors (no copies on the CPU)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


class CpuAttentionBackend(AttentionBackend[CpuAttnMetadata]):
    """Mixed prefill/decode attention over the paged KV cache in one C kernel call per layer."""

    name = "cpu"
    support = attention_support(name)

    @staticmethod
    def available() -> bool:
        """Whether the C kernels load here (a C compiler, and ENGINE_CPU_KERNELS not 0)."""
        return c_kernels_available()

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """[2, num_blocks, kv_heads, block_size, head_dim]; the key half is read as
        [num_blocks, kv_heads, head_dim, block_size] (see split_cache)."""
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

    @staticmethod
    def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache [N, Hkv, D, bs], value_cache [N, Hkv, bs, D]) views of one layer's cache."""
        num_blocks, kv_heads, block_size, head_dim = kv_cache.shape[1:]
        return kv_cache[0].view(num_blocks, kv_heads, head_dim, block_size), kv_cache[1]

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> CpuAttnMetadata:
        return CpuAttnMetadata(
            device_batch.slot_mapping,
            device_batch.block_table,
            device_batch.query_start_loc,
            device_batch.seq_lens,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CpuAttnMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; writes k/v into the cache, returns [T, Hq, D]."""
        key_cache, value_cache = self.split_cache(kv_cache)
        write_kv_cpu(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention_cpu(
            q,
            key_cache,
            value_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window=sliding_window,
            sinks=sinks,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
