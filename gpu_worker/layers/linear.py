"""Linear and embedding layers whose weights start uninitialized (the loader fills them)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.layers.dense_linear import DenseLinearMethod
from gpu_worker.layers.linear_method import EmbeddingMethod, LinearMethod


class Linear(nn.Module):
    """y = x @ W^T (+ b); W is [out_features, in_features] as in Hugging Face checkpoints.

    One LinearMethod holds W and applies it: dense (the `weight` parameter the loader fills)
    until a loader gives the layer another (use_method: GGUF-quantized parts, the CPU's
    layouts) or the method re-lays W for its device after loading
    (process_weights_after_loading).
    """

    weight: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method: LinearMethod = DenseLinearMethod(in_features, out_features)
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def use_method(self, method: LinearMethod, keep_weight: bool = False) -> None:
        """Apply W through method from now on; the dense weight is dropped unless keep_weight
        (a weight tied to the embedding stays)."""
        _check_fits(method, "weight", (self.out_features, self.in_features))
        self.method = method
        if not keep_weight:
            self.weight = None

    def process_weights_after_loading(self, keep_weight: bool) -> None:
        """Re-lay the loaded W for its device where the method has a better layout there;
        keep_weight as in use_method."""
        method = self.method.process_weights_after_loading(self)
        if method is not self.method:
            self.use_method(method, keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def project(
        self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W^T + bias (another bias than the layer's, or none). out, a contiguous fp32
        buffer of the result's shape, receives the result where the C kernels compute it (use
        the return)."""
        return self.method.apply(self, x, bias, out)


class Embedding(nn.Module):
    """Token embedding table W [vocab, hidden], looked up by one EmbeddingMethod: dense until
    the loader gives it a GGUF-quantized one (use_method), whose rows are dequantized to the
    model's dtype as they are looked up."""

    weight: nn.Parameter | None
    dtype: torch.dtype  # the model's dtype, what a quantized table's lookups return

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        dense = DenseLinearMethod(embedding_dim, num_embeddings)
        dense.create_weights(self)
        self.method: EmbeddingMethod = dense

    def use_method(self, method: EmbeddingMethod) -> None:
        """Look rows up through method from now on and drop the dense table (a tied output
        projection keeps its own reference)."""
        _check_fits(method, "table", (self.num_embeddings, self.embedding_dim))
        method.check_table()
        assert self.weight is not None  # the dense table, until a method replaces it
        self.dtype = self.weight.dtype
        self.method = method
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, ids)


def _check_fits(method: LinearMethod, what: str, shape: tuple[int, int]) -> None:
    if (method.out_features, method.in_features) != shape:
        raise ValueError(
            f"quantized {what} [{method.out_features}, {method.in_features}] does not fit {shape}"
        )
