"""Linear and embedding layers split across the tensor-parallel ranks (Megatron style).

Each sharded parameter records the dimension along which it is a slice of the checkpoint tensor
(tp_dim) and, where the last rank's slice is padded, the checkpoint's size along it
(tp_full_size); the weight loader cuts each checkpoint tensor for this rank from those.
"""

from __future__ import annotations

import torch

from gpu_worker.layers.linear import Embedding, Linear
from gpu_worker.parallel.group import tp_all_gather, tp_all_reduce, tp_rank, tp_world_size


def _shard(param: torch.Tensor, dim: int, full_size: int | None = None) -> None:
    param.tp_dim = dim
    if full_size is not None:
        param.tp_full_size = full_size


def divide(size: int, what: str) -> int:
    """This rank's share of size; refuses a size the ranks cannot split evenly."""
    world = tp_world_size()
    if size % world:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {world}")
    return size // world


class ColumnParallelLinear(Linear):
    """Each rank holds out_features / TP rows of W and computes its slice of y; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, "output features"), bias)
        _shard(self.weight, 0)
        if self.bias is not None:
            _shard(self.bias, 0)


class RowParallelLinear(Linear):
    """Each rank holds in_features / TP columns of W; partial outputs are summed across ranks.

    The bias (replicated) is added by rank 0 alone, before the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, "input features"), out_features, bias)
        _shard(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.project(x, self.bias if tp_rank() == 0 else None))


class VocabParallelEmbedding(Embedding):
    """Each rank holds ceil(V / TP) rows of the table; ids outside them embed to zero, then sum."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        rows = -(-num_embeddings // tp_world_size())
        super().__init__(rows, embedding_dim)
        self.rows = rows
        self.start = tp_rank() * self.rows
        _shard(self.weight, 0, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self.method.embedding(self, local.masked_fill(outside, 0))
        return tp_all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear):
    """The output projection split by vocabulary like VocabParallelEmbedding.

    Every rank computes the logits of its vocabulary slice and all-gathers them, so each rank
    holds the full distribution and samples the same tokens as the others.
    """

    def __init__(self, in_features: int, vocab_size: int) -> None:
        super().__init__(in_features, -(-vocab_size // tp_world_size()))
        self.vocab_size = vocab_size
        _shard(self.weight, 0, vocab_size)

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax over the vocabulary [N] without the logits, where the method's
        kernel fuses them (one rank, fp32 rows on the CPU: the blocked layout, or a GGUF weight
        of one type for up to quant_few_rows() rows); None elsewhere."""
        if tp_world_size() != 1 or x.dtype != torch.float32 or x.dim() != 2:
            return None
        return self.method.greedy_argmax(x, self.vocab_size)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., vocab]; out (a buffer for them, one rank only) may receive them."""
        if tp_world_size() == 1:
            return self.project(x, None, out)[..., : self.vocab_size]
        return tp_all_gather(self.project(x, None))[..., : self.vocab_size]
