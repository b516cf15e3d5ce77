"""Re-laying a loaded model's weights: each Linear's method on every device, then on the CPU
the CPU's layouts (one policy, here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from gpu_worker.layers.cpu_linear import BlockedLinearMethod, SplitLinearMethod
from gpu_worker.layers.dense_linear import DenseLinearMethod
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.linear import Linear
from gpu_worker.models.blocks import GatedMLP
from kernels import cpu_binding


def process_weights_after_loading(model: nn.Module, device: torch.device, threads: int) -> None:
    """Let every Linear's method re-lay its loaded W for the device, then on the CPU give the
    weights the CPU's layouts (_use_cpu_layout, matmuls on `threads` threads)."""
    shared = _shared_weights(model)
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading(keep_weight=shared(module))
    if device.type == "cpu":
        _use_cpu_layout(model, threads, shared)


def _use_cpu_layout(model: nn.Module, threads: int, shared: Callable[[Linear], bool]) -> None:
    """Re-lay every weight of a loaded model for fast CPU matmuls on `threads` threads, freeing
    the dense copies no other module shares.

    With the C kernels (fp32), each MLP takes the fused SwiGLU layout where it pays, and every
    other dense Linear the blocked layout, and each mixture of experts its C kernel's layout;
    without them, each MLP splits across the threads where it divides evenly, and the other
    dense Linears take the split layout."""
    c_kernels = cpu_binding.available() and next(model.parameters()).dtype == torch.float32
    for module in model.modules():  # parents first: an MLP may re-lay its projections itself
        if isinstance(module, GatedMLP):
            if c_kernels:
                module.use_fused_swiglu()
            else:
                module.use_thread_split(threads)
        elif isinstance(module, Linear):
            use_cpu_linear_layout(module, threads, keep_weight=shared(module))
        elif isinstance(module, FusedMoE) and c_kernels:
            module.use_cpu_layout()


def use_cpu_linear_layout(layer: Linear, threads: int, keep_weight: bool) -> None:
    """A dense W on the CPU as the C kernel's blocked layout where it runs, else split across
    `threads` threads where its rows divide evenly; other methods keep their own layout.
    keep_weight as in Linear.use_method."""
    weight = layer.weight
    if not isinstance(layer.method, DenseLinearMethod) or weight is None:
        return
    if weight.device.type != "cpu":
        return
    if BlockedLinearMethod.applies(weight):
        layer.use_method(BlockedLinearMethod(weight), keep_weight)
    elif layer.out_features % threads == 0:
        layer.use_method(SplitLinearMethod(weight, threads), keep_weight)


def _shared_weights(model: nn.Module) -> Callable[[Linear], bool]:
    """Whether a Linear's weight is registered under two names (the embedding an output
    projection is tied to)."""
    names = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return lambda linear: linear.weight is not None and names[id(linear.weight)] > 1
