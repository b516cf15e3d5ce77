"""Re-laying a loaded model's weights for the CPU's kernels."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from gpu_worker.layers.linear import Linear
from gpu_worker.models.blocks import GatedMLP
from kernels import cpu_binding


def use_cpu_layout(model: nn.Module, threads: int) -> None:
    """Re-lay every weight of a loaded model for fast CPU matmuls on `threads` threads, freeing
    the dense copies no other module shares.

    With the C kernels (fp32), each MLP takes the fused SwiGLU layout where it pays, and every
    other Linear its method's layout (the blocked one for dense weights); without them, each
    MLP splits across the threads where it divides evenly, and the other Linears take the split
    layout."""
    c_kernels = cpu_binding.available() and next(model.parameters()).dtype == torch.float32
    # A parameter registered under two names (the embedding an output projection is tied to).
    names = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for module in model.modules():  # parents first: an MLP may re-lay its projections itself
        if isinstance(module, GatedMLP):
            if c_kernels:
                module.use_fused_swiglu()
            else:
                module.use_thread_split(threads)
        elif isinstance(module, Linear):
            shared = module.weight is not None and names[id(module.weight)] > 1
            module.process_weights_after_loading(threads, keep_weight=shared)
