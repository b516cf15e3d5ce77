"""W as a dense parameter of the layer, applied with torch: every Linear starts so."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.linear_method import EmbeddingMethod

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Embedding, Linear


class DenseLinearMethod(EmbeddingMethod):
    """W is the layer's `weight` parameter [out_features, in_features] in the model's dtype:
    F.linear on any device, F.embedding for a token table (the CPU's layouts of W are chosen
    by gpu_worker/loader/cpu_layout.py)."""

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

    def nbytes(self, layer: Linear) -> int:
        weight = layer.weight
        return 0 if weight is None else weight.numel() * weight.element_size()


def _weight(layer: Linear | Embedding) -> torch.Tensor:
    weight = layer.weight  # read once: each read is an nn.Module attribute lookup
    assert weight is not None  # a layer drops its dense weight only as it takes another method
    return weight
