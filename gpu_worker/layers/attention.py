"""Attention layer: hands q/k/v and its own KV cache to the step's attention backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.forward_context import get_attn_metadata
from gpu_worker.parallel.group import tp_world_size


class Attention(nn.Module):
    """Paged attention of one layer; kv_cache is bound by the model runner after allocation.

    sliding_window: this layer attends to its last sliding_window positions only (a query at
    position p sees keys at p - sliding_window + 1 .. p), None for the whole context. sinks: a
    learned logit per query head (gpt-oss) that joins the softmax's denominator and attends to
    nothing; the `sinks` parameter holds this rank's heads. The backend is handed only the
    features the layer has, so a backend is asked for a feature only where a model uses it.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: bool = False,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Gemma 2: scores become cap * tanh(scores / cap) before the softmax (scores scaled).
        self.logits_soft_cap = logits_soft_cap
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.tp_dim = 0  # type: ignore[attr-defined]  # this rank's query heads
            if tp_world_size() > 1:
                self.sinks.tp_full_size = num_heads * tp_world_size()  # type: ignore[attr-defined]
        self.kv_cache = torch.empty(0)
        # An fp8 KV cache's scales (stored = value / scale): the checkpoint's k_scale and v_scale
        # where it has them (set by the loader), else 1.0. Unused by a cache in the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = get_attn_metadata()
        features: dict[str, Any] = {}  # only the features the layer has (backend contract)
        if self.sliding_window is not None:
            features["sliding_window"] = self.sliding_window
        if self.sinks is not None:
            features["sinks"] = self.sinks
        if self.logits_soft_cap is not None:
            features["logits_soft_cap"] = self.logits_soft_cap
        if self.kv_cache.dtype == torch.float8_e4m3fn:
            features["k_scale"], features["v_scale"] = self.k_scale, self.v_scale
        return step.backend.forward(q, k, v, self.kv_cache, step.metadata, self.scale, **features)
