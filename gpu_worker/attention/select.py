"""Choosing the attention backend for a device."""

from __future__ import annotations

from typing import Any

import torch

from config.attention import (
    ATTENTION_BACKENDS,
    PLAIN_ATTENTION,
    AttentionFeatures,
    attention_backends_for,
)
from config.errors import ConfigError
from gpu_worker.attention.backend import AttentionBackend

# Triton converts float8_e4m3fn (an fp8 KV cache's loads) only from compute capability 8.9
# (Ada, Hopper); it refuses the type below.
FP8_KV_MIN_CAPABILITY = (8, 9)


def attention_backend(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    block_size: int = 16,
    features: AttentionFeatures = PLAIN_ATTENTION,
) -> AttentionBackend[Any]:
    """The first of the device type's backends, in config.attention.ATTENTION_BACKENDS' order,
    whose class's support runs this dtype, head size, block size and features and whose code is
    available here: Triton kernels on CUDA; on the CPU the C kernels (fp32, head_dim 64 or 128,
    block_size a multiple of 16) when they build here, else vectorized torch ops. Raises
    ConfigError naming each backend's reason when none runs them (resolve() refuses such a
    config first), and an fp8 KV cache on a CUDA device below compute capability 8.9."""
    if features.kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_KV_MIN_CAPABILITY:
            raise ConfigError(
                f"kv_cache_dtype fp8 needs a CUDA device of compute capability 8.9 or newer "
                f"(the Triton attention kernels read float8_e4m3fn, which Triton compiles "
                f"from 8.9 only); {device} has {capability[0]}.{capability[1]}: use "
                f"kv_cache_dtype auto"
            )
    dtype_name = str(dtype).removeprefix("torch.")
    table = ATTENTION_BACKENDS.get(device.type, ())
    classes = [backend_class(support.backend) for support in table]
    runs = [
        cls
        for cls in classes
        if cls.support.refusal(block_size, head_dim, dtype_name, features) is None
    ]
    if not runs:
        # Raises ConfigError in the configuration's words, naming each backend's reason.
        attention_backends_for(device.type, block_size, head_dim, dtype_name, features)
        raise AssertionError("a backend class's support differs from its table entry")
    for cls in runs:
        if cls.available():
            return cls()
    names = [cls.name for cls in runs]
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
    if name == "mla_torch":
        from gpu_worker.attention.mla_backend import MLATorchBackend

        return MLATorchBackend
    if name == "mla_triton":
        from gpu_worker.attention.mla_triton_backend import MLATritonBackend

        return MLATritonBackend
    raise AssertionError(f"config.attention names an attention backend {name!r} with no class")
