"""W as a dense parameter of the layer, applied with torch: every Linear starts so."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.cpu_linear import BlockedLinearMethod, SplitLinearMethod
from gpu_worker.layers.linear_method import EmbeddingMethod, LinearMethod

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Embedding, Linear


class DenseLinearMethod(EmbeddingMethod):
    """W is the layer's `weight` parameter [out_features, in_features] in the model's dtype:
    F.linear on any device, F.embedding for a token table. On the CPU the loaded W is re-laid
    for the C kernel (the blocked layout) where it runs, else for the threads (the split one)."""

    def create_weights(self, layer: Linear | Embedding) -> None:
        layer.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features), requires_grad=False
        )

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.linear(x, _weight(layer), bias)

    def embedding(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, _weight(layer))

    def process_weights_after_loading(self, layer: Linear, threads: int) -> LinearMethod:
        weight = layer.weight
        if weight is None or weight.device.type != "cpu":
            return self
        if BlockedLinearMethod.applies(weight):
            return BlockedLinearMethod(weight)
        if self.out_features % threads == 0:
            return SplitLinearMethod(weight, threads)
        return self

    def nbytes(self, layer: Linear) -> int:
        weight = layer.weight
        return 0 if weight is None else weight.numel() * weight.element_size()


def _weight(layer: Linear | Embedding) -> torch.Tensor:
    if layer.weight is None:  # a thread-split MLP holds its projections' weights itself
        raise RuntimeError(f"{type(layer).__name__}'s dense weight was re-laid by its parent")
    return layer.weight
