"""The contract between a Linear layer and the way its weight is held and applied.

A Linear's weight W is [out_features, in_features], as in Hugging Face checkpoints. One
LinearMethod object holds W in one layout and computes x @ W^T + b from it: dense for torch
(dense_linear.py), re-laid for the C kernels or the CPU threads (cpu_linear.py), GGUF-quantized
for the C or the Triton kernels (quant_linear.py). A new weight format (FP8, int4) is a new
subclass, not a new attribute of the layer. Its life, as in vLLM's LinearMethodBase:
create_weights (or a loader building the method from weights it read), the checkpoint loaded,
process_weights_after_loading, then apply at every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Embedding, Linear


class LinearMethod(ABC):
    """How one Linear's W [out_features, in_features] is held, re-laid and applied."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features

    def create_weights(self, layer: Linear) -> None:
        """Register on layer the parameters the checkpoint loader fills, under the checkpoint's
        names and shapes (the layer's `weight` [out_features, in_features]); a method built from
        weights a loader already read (the GGUF ones) registers none."""
        return None

    @abstractmethod
    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in_features] @ W^T + bias as [..., out_features] in x's dtype. out, a
        contiguous fp32 buffer of the result's shape, receives the result where a C kernel
        writes it; callers use the return either way."""

    def process_weights_after_loading(self, layer: Linear) -> LinearMethod:
        """The method that applies the loaded W on its device from now on (called on every
        device once the checkpoint is loaded): self where W stays as it is, else a new method
        holding W re-laid (the layer then drops its dense weight unless another module shares
        it). The CPU's layouts of dense weights are chosen by gpu_worker/loader/cpu_layout.py."""
        return self

    @abstractmethod
    def nbytes(self, layer: Linear) -> int:
        """Bytes of W in the layout this method reads (what one decode step streams)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x @ gate^T) * (x @ up^T) as [..., out_features / 2] for W = [gate; up], where
        this layout has a kernel that never writes x @ W^T; None elsewhere (then: apply, and
        the activation on its result)."""
        return None

    def greedy_argmax(self, x: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Each row's argmax over the first `vocab` columns of x [M, in_features] @ W^T (fp32
        rows), [M] int64, without writing those columns, where a kernel fuses the two; None
        elsewhere (then: apply, and the argmax of its result)."""
        return None

    def cpu_kernel_weight(self) -> tuple[int, torch.Tensor] | None:
        """W as the one tensor the fused CPU decode kernel (kernels/decode_stack.py) reads, with
        its layout code (a GGML type number, F32_BLOCKED or F32_PAIRS); None where W is held
        in another layout."""
        return None


class EmbeddingMethod(LinearMethod):
    """A LinearMethod whose W can also be a token embedding table [num_embeddings,
    embedding_dim] (out_features, in_features), as a tied output projection shares it."""

    @abstractmethod
    def embedding(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (int64, any shape, each below num_embeddings) of W as
        [*ids.shape, embedding_dim] in the layer's dtype."""

    def check_table(self) -> None:
        """Raise ValueError where W cannot be looked up as one token table (checked once, as
        an Embedding takes the method)."""
        return None


def rows_and_out(
    x: torch.Tensor, in_features: int, out_features: int, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., in_features] as rows [M, in_features], and the [M, out_features] result: out
    viewed so where the caller gives one, else a new tensor in x's dtype on x's device (for
    methods whose kernels write each part's columns of one output)."""
    rows = x.reshape(-1, in_features)
    if out is None:
        return rows, torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    return rows, out.view(rows.shape[0], out_features)
