"""Multi-head latent attention through the Triton kernel in kernels/triton/mla_attention.py: the
CUDA backend of MLA models (DeepSeek-V2/V3).

The latent cache and the contract are mla_backend.py's (one vector [c_kv | k_pe] per token, one
KV head of it; forward's k is the step's latent vectors, v their c_kv part). The kernel reads
the device batch directly, so build() plans nothing on the host and a decode step can be
captured in a CUDA graph; padded graph rows (slot -1) write nothing.
"""

from __future__ import annotations

import torch

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.attention.mla_backend import MLATorchBackend, check_latent_kv
from kernels.triton.mla_attention import mla_attention, write_latent


class MLATritonBackend(AttentionBackend[DeviceBatch]):
    """Latent-cache attention in one Triton launch per layer for mixed prefill/decode steps."""

    name = "mla_triton"
    support = attention_support(name)
    compiles_kernels = True
    supports_cuda_graphs = True  # build() keeps the device batch's tensors

    kv_cache_shape = staticmethod(MLATorchBackend.kv_cache_shape)

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> DeviceBatch:
        """The kernel reads the device batch directly."""
        return device_batch

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
        """As MLATorchBackend.forward: q [T, H, L], k [T, 1, L] (written), v = k[..., :Dv];
        returns [T, H, Dv]."""
        assert sliding_window is None and sinks is None and logits_soft_cap is None, (
            "the MLA backend's support has none of them"
        )
        assert k_scale == v_scale == 1.0, "an fp8 KV cache is refused with MLA (no scales)"
        check_latent_kv(k, v)
        write_latent(k[:, 0], kv_cache, meta.slot_mapping)
        return mla_attention(
            q,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            v.shape[-1],
            meta.max_query_len,
        )
