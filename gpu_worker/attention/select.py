"""Choosing the attention backend for a device."""

from __future__ import annotations

from typing import Any

import torch

from config.attention import PLAIN_ATTENTION, AttentionFeatures, attention_backends_for
from gpu_worker.attention.backend import AttentionBackend


def attention_backend(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    block_size: int = 16,
    features: AttentionFeatures = PLAIN_ATTENTION,
) -> AttentionBackend[Any]:
    """The first backend of config.attention.ATTENTION_BACKENDS for the device type that runs
    this dtype, head size, block size and features, and whose code is available here: Triton
    kernels on CUDA; on the CPU the C kernels (fp32, head_dim 64 or 128, block_size a multiple
    of 16) when they build here, else vectorized torch ops. Raises ConfigError when no backend
    runs them (resolve() refuses such a config first)."""
    dtype_name = str(dtype).removeprefix("torch.")
    names = attention_backends_for(device.type, block_size, head_dim, dtype_name, features)
    for name in names:
        backend = backend_class(name)
        if backend.available():
            return backend()
    raise AssertionError(f"none of the attention backends {names} is usable on {device.type}")


def backend_class(name: str) -> type[AttentionBackend[Any]]:
    """The class of the backend config.attention's table names; imported only when asked for
    (the Triton backend imports Triton)."""
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "cpu":
        from gpu_worker.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    raise AssertionError(f"config.attention names an attention backend {name!r} with no class")
