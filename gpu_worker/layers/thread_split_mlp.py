"""The gated MLP's CPU layout where the C kernels do not run: its weights split across the
threads like tensor parallelism."""

from __future__ import annotations

import torch

from gpu_worker.layers.activation import silu_and_mul
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.linear_method import LinearMethod

# Rows of one MLP pass on the CPU. Bigger steps go through in slices: the intermediate
# activations of 8192 rows are ~100 MB, which glibc maps fresh (and the kernel zeroes) on every
# call, while a 1024-row slice stays in reused, cache-warm memory (MLP of 4803 rows measured at
# 185 GFLOP/s whole and 208 in 1024-row slices).
_MLP_ROWS = 1024


class ThreadSplitMLP:
    """down(silu(x @ gate^T) * (x @ up^T)) with thread s holding gate and up columns
    [s*I/S, (s+1)*I/S) and the matching rows of down, so one bmm computes each slice's
    activations and another its partial output; summing the S partial outputs replaces the
    transpose copies a column split alone would need. Under tensor parallelism I is this rank's
    share, and the caller's sum over ranks follows the sum over S."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, splits: int) -> None:
        """gate_up: [2I, H] (gate rows, then up rows); down: [H, I]; S = splits divides I."""
        inter = down.shape[1]
        gate_up = gate_up.detach().t()  # [H, 2I]
        hidden = gate_up.shape[0]
        gate = gate_up[:, :inter].reshape(hidden, splits, -1)
        up = gate_up[:, inter:].reshape(hidden, splits, -1)
        self.gate_up = torch.cat([gate, up], dim=-1).transpose(0, 1).contiguous()
        self.down = down.detach().t().reshape(splits, -1, hidden).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's MLP output for x [T, H] (before the sum over ranks)."""
        if x.shape[0] <= _MLP_ROWS:
            return self._slice(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], _MLP_ROWS):
            out[start : start + _MLP_ROWS] = self._slice(x[start : start + _MLP_ROWS])
        return out

    def _slice(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.bmm(x.unsqueeze(0).expand(self.gate_up.shape[0], -1, -1), self.gate_up)
        return torch.bmm(silu_and_mul(y), self.down).sum(dim=0)


class ThreadSplitPart(LinearMethod):
    """One projection of a thread-split MLP: its W lives re-laid in the ThreadSplitMLP, which
    applies both projections together, so the projection alone refuses to run."""

    def __init__(self, layer: Linear, held: torch.Tensor) -> None:
        """held: the ThreadSplitMLP's tensor holding layer's W."""
        super().__init__(layer.in_features, layer.out_features)
        self.held = held

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise RuntimeError("a thread-split MLP's projection runs only inside its MLP")

    def nbytes(self, layer: Linear) -> int:
        return self.held.numel() * self.held.element_size()
