"""Choosing a kernel's implementation for a device."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from kernels.cpu_binding import available

F = TypeVar("F", bound=Callable)


def kernel_for(device: torch.device, triton_impl: Callable[[], F], cpu_impl: F, torch_impl: F) -> F:
    """triton_impl() on CUDA, cpu_impl (a C binding) on a CPU where the C kernels are built,
    torch_impl otherwise. triton_impl returns the Triton launcher, importing its module
    (kernels/triton/<op>.py) only then: a process that never asks for CUDA never imports Triton."""
    if device.type == "cuda":
        return triton_impl()
    if device.type == "cpu" and available():
        return cpu_impl
    return torch_impl
