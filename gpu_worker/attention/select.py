"""Choosing the attention backend for a device."""

from __future__ import annotations

import torch


def attention_backend(device: torch.device):
    """Triton kernels on CUDA, vectorized torch elsewhere."""
    if device.type == "cuda":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from gpu_worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
