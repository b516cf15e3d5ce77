"""Attention layer: hands q/k/v and its own KV cache to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_context import get_attn_metadata


class Attention(nn.Module):
    """Paged attention of one layer; kv_cache is bound by the model runner after allocation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = get_attn_metadata()
        return step.backend.forward(q, k, v, self.kv_cache, step.metadata, self.scale)
