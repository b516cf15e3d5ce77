"""RMSNorm, optionally fused with the residual add: one Triton kernel on CUDA
(kernels/triton/rms_norm.py, imported only there), the C kernels for fp32 on the CPU (kernels/
rms_norm.py), else torch ops."""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_binding, rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            if rms_norm.flattens(x):
                from kernels.triton.rms_norm import rms_norm as rms_norm_triton

                return rms_norm_triton(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); may update residual in place."""
        if cpu_binding.applies(x) and x.is_contiguous() and residual.is_contiguous():
            return rms_norm.add_rms_norm_cpu(x, residual, self.weight, self.eps)
        if x.device.type == "cuda" and residual.shape == x.shape and residual.dtype == x.dtype:
            if rms_norm.flattens(x) and rms_norm.flattens(residual):
                from kernels.triton.rms_norm import add_rms_norm

                # One kernel: residual += x in place, then the norm of the rounded sum.
                return add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual
