"""How a gated MLP runs its two projections: one MLPLayout object, chosen once after loading."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from gpu_worker.layers.activation import silu_and_mul
from gpu_worker.layers.cpu_linear import SwiGLUPairsLinearMethod
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.thread_split_mlp import ThreadSplitMLP
from gpu_worker.parallel.group import tp_all_reduce


class MLPLayout(ABC):
    """down(silu(x @ gate^T) * (x @ up^T)) from the gate_up [2I, H] and down [H, I]
    projections, summed over the tensor-parallel ranks."""

    @abstractmethod
    def forward(self, gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output for x [T, H] as [T, H]."""


class PlainMLP(MLPLayout):
    """Each projection through its own method, the activation between them (SiLU unless
    given another of GATED_ACTIVATIONS)."""

    def __init__(self, act_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        self.act_and_mul = act_and_mul

    def forward(self, gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
        return down(self.act_and_mul(gate_up(x)))


class FusedSwiGLUMLP(MLPLayout):
    """gate_up held as SwiGLU pairs: one kernel computes the activation without writing the
    [T, 2I] projection (fp32 x: the layout is chosen only for an fp32 model on the CPU)."""

    def __init__(self, pairs: SwiGLUPairsLinearMethod) -> None:
        self.pairs = pairs

    def forward(self, gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
        return down(self.pairs.silu_and_mul(x))


class ThreadSplitMLPLayout(MLPLayout):
    """Both projections split across the CPU threads (ThreadSplitMLP), which holds their
    weights; this rank's output is then summed over the ranks."""

    def __init__(self, split: ThreadSplitMLP) -> None:
        self.split = split

    def forward(self, gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.split(x))
