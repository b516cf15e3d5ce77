"""Linear and embedding layers whose weights start uninitialized (the loader fills them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# Row count from which F.linear beats the split layout plus its output copy, measured on the
# 49152 x 576 output projection (2 threads, dev box): split + copy 22.6 ms against 27.9 at 64
# rows, 38.6 against 43.9 at 128, 190 against 89 at 256.
_MANY_ROWS = 129


class Linear(nn.Module):
    """y = x @ W^T (+ b); W is [out_features, in_features] as in Hugging Face checkpoints.

    On CPU, use_split_layout() re-lays W as [S, in, out/S] for S threads: one batched matmul
    then gives each thread a contiguous slice of W to stream, which reads memory about twice
    as fast as MKL's single-row GEMV and is no slower for large batches.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.split_weight: torch.Tensor | None = None

    def use_split_layout(self, splits: int) -> None:
        """Switch to the [splits, in, out/splits] layout (CPU only; out must divide evenly)."""
        if self.weight is None:  # already re-laid by the module that owns it
            return
        out_features, in_features = self.weight.shape
        if out_features % splits:
            return
        self.split_weight = (self.weight.detach().t().reshape(in_features, splits, -1)
                             .transpose(0, 1).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias in whichever layout W is held."""
        rows = x.reshape(-1, x.shape[-1])
        # With many rows the split layout's output transpose costs more than it saves; use W
        # itself when it is still held (a weight tied to the embedding is).
        if self.split_weight is None or (self.weight is not None and rows.shape[0] >= _MANY_ROWS):
            return F.linear(x, self.weight, bias)
        splits = self.split_weight.shape[0]
        y = torch.bmm(rows.unsqueeze(0).expand(splits, -1, -1), self.split_weight)
        y = y.transpose(0, 1).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def use_cpu_layout(model: nn.Module, threads: int) -> None:
    """Re-lay every Linear of a loaded model for fast CPU matmuls; frees the old layout."""
    for module in model.modules():  # parents first: a module may re-lay its children itself
        if isinstance(module, Linear):
            module.use_split_layout(threads)
            if module.split_weight is not None and not _shared(module, model):
                module.weight = None
        elif hasattr(module, "use_split_layout"):
            module.use_split_layout(threads)


def _shared(linear: Linear, model: nn.Module) -> bool:
    """True when the Linear's weight is also used elsewhere (tied embeddings)."""
    return any(m is not linear and getattr(m, "weight", None) is linear.weight
               for m in model.modules())
