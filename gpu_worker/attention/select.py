"""Choosing the attention backend for a device."""

from __future__ import annotations

import torch

# Head sizes the C kernel is compiled for (kernels/cpu/paged_attention.c).
_CPU_KERNEL_HEAD_DIMS = (64, 128)


def attention_backend(device: torch.device, dtype: torch.dtype = torch.float32, head_dim: int = 64,
                      block_size: int = 16):
    """Triton kernels on CUDA; on the CPU the C kernels for fp32 when they build here (head_dim
    64 or 128, block_size a multiple of 16), else vectorized torch ops."""
    if device.type == "cuda":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kernels.cpu_ops import available

    if (dtype == torch.float32 and head_dim in _CPU_KERNEL_HEAD_DIMS and block_size % 16 == 0
            and available()):
        from gpu_worker.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    from gpu_worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
