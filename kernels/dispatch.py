"""Choosing a kernel's implementation for a device."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def kernel_for(device: torch.device, cuda: Callable[[], F], cpu_name: str, torch_impl: F) -> F:
    """The Triton implementation (cuda() imports it) on CUDA, kernels.cpu_ops.<cpu_name> on a
    CPU where the C kernels are built, torch_impl otherwise."""
    if device.type == "cuda":
        return cuda()
    if device.type == "cpu":
        from kernels import cpu_ops

        if cpu_ops.available():
            return getattr(cpu_ops, cpu_name)
    return torch_impl
