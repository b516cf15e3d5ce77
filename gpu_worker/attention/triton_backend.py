"""Paged attention through the Triton kernels in kernels/triton/ (the CUDA backend); imported only
when selected (gpu_worker/attention/select.py)."""

from __future__ import annotations

import functools

import torch

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from kernels.triton.paged_attention import paged_attention
from kernels.triton.paged_decode import SPLIT_MIN_SEQ_LEN, paged_decode_split, use_split_decode
from kernels.triton.write_kv import write_kv

# The interpreter (CPU tensors, tests) has no SMs: decide as on an H100 so tests take GPU paths.
_NOMINAL_NUM_SMS = 132


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _NOMINAL_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


class TritonAttentionBackend(AttentionBackend[DeviceBatch]):
    """Writes K/V by slot mapping and runs mixed prefill/decode attention over block tables;
    decode-only steps with too few sequences to fill the device split their contexts."""

    name = "triton"
    support = attention_support(name)
    compiles_kernels = True
    # The split-context decode kernels run from this context length.
    warm_up_context_len = SPLIT_MIN_SEQ_LEN
    supports_cuda_graphs = True  # build() keeps the device batch's tensors

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The kernels' layout: [2, num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> DeviceBatch:
        """The kernels read the device batch directly."""
        return device_batch

    @staticmethod
    def uses_split_decode(meta: DeviceBatch, num_kv_heads: int, device: torch.device) -> bool:
        """Whether forward runs this step through the split-context decode kernels; decided from
        host values only (no device sync)."""
        return use_split_decode(
            meta.max_query_len,
            meta.seq_lens.shape[0],
            num_kv_heads,
            meta.max_seq_len,
            _num_sms(device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: DeviceBatch,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]. A layer whose window is shorter
        than the split's threshold reads too few keys to gain from splitting them: it takes the
        one-pass kernel in every step (the same in a captured graph and at its replay)."""
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, k_scale, v_scale)
        short_window = sliding_window is not None and sliding_window < SPLIT_MIN_SEQ_LEN
        if not short_window and self.uses_split_decode(meta, kv_cache.shape[3], q.device):
            return paged_decode_split(
                q,
                kv_cache[0],
                kv_cache[1],
                meta.block_table,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                sliding_window=sliding_window,
                sinks=sinks,
                logits_soft_cap=logits_soft_cap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
            sliding_window=sliding_window,
            sinks=sinks,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
