"""What every C kernel's binding shares: the loaded library and the layout checks it runs before
handing a tensor's memory to C (kernels/cpu_library.py builds and loads the library).

A binding checks the layout it relies on and raises ValueError otherwise, so a caller can never
hand the kernels memory they would misread.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_library import load


def available() -> bool:
    """True when the C kernels are built and loaded on this machine."""
    return load() is not None


def applies(x: torch.Tensor) -> bool:
    """Whether the fused kernels can take this activation: fp32, on the CPU, library loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError where it cannot be built."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib


def check_cpu(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    """ValueError unless t is a CPU tensor of dtype."""
    if not t.is_cpu or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")


def check_rows(t: torch.Tensor, name: str) -> None:
    """Every dimension but the first is packed (the first may have any stride)."""
    if t.is_contiguous():  # the common case, without walking the strides in Python
        return
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name} must be contiguous after its first dimension")
        expected *= size


def check_bias(bias: torch.Tensor | None, out_features: int) -> None:
    """ValueError unless bias is None or a packed fp32 [out_features]."""
    if bias is not None:
        check_cpu(bias, "bias")
        if bias.shape != (out_features,) or not bias.is_contiguous():
            raise ValueError(f"bias {tuple(bias.shape)} does not match {out_features} outputs")


def as_matrix(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] as [M, K] with packed rows (any row stride)."""
    rows = x.reshape(-1, in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()
