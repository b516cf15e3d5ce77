"""The gated MLP's activation: silu(gate) * up (SwiGLU), or gelu_tanh(gate) * up (GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import activation, cpu_binding


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y = [..., gate | up]: one fused pass in fp32 on the CPU and, with
    Triton, on CUDA."""
    if cpu_binding.applies(y):
        return activation.silu_and_mul_cpu(y)
    if y.device.type == "cuda" and activation.fits(y):
        from kernels.triton.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(y: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for y = [..., gate | up] (Gemma's
    gelu_pytorch_tanh), in torch ops."""
    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# The gate activations GatedMLP takes, by config.json's hidden_activation / hidden_act name.
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
