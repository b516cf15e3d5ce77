"""Paged attention in vectorized PyTorch: the CPU backend.

A step is planned on the host by host_plan.py: decodes and prefill chunks in two groups, each
with gather indices and masks built once a step (a sliding window's at its first layer of the
step). Each group gathers its requests' K/V from the paged cache with one index per layer and
runs one batched scaled_dot_product_attention. Sinks add one logit per head to the softmax's
denominator and a soft cap bends every score before it, which scaled_dot_product_attention
cannot: such layers run the softmax themselves.

An fp8 cache (float8_e4m3fn) holds k / k_scale and v / v_scale (kernels/write_kv.py's
quantize_kv); the gathered keys and values are converted exactly to q's dtype and the scales
applied to the fp32 scores (k_scale) and the output (v_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.host_plan import Group, KeyView, is_whole, plan_step
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from kernels.write_kv import quantize_kv


@dataclass(slots=True)
class TorchAttnMetadata:
    """Per-step metadata of the torch backend."""

    slot_mapping: torch.Tensor
    groups: list[Group]
    num_tokens: int


class TorchAttentionBackend(AttentionBackend[TorchAttnMetadata]):
    """Mixed prefill/decode attention over the paged KV cache with plain torch ops."""

    name = "torch"
    support = attention_support(name)
    plans_on_host = True  # build() reads the step's host arrays (StepBatch)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The kernels' layout, [2, num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> TorchAttnMetadata:
        """Precompute gather indices and masks for the whole step."""
        assert step is not None, "plans_on_host: the runner hands in the host arrays"
        groups = plan_step(step, device)
        return TorchAttnMetadata(device_batch.slot_mapping, groups, int(step.query_start_loc[-1]))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttnMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; writes k/v into the cache, returns [T, Hq, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if fp8:
            # index_copy_ has no float8 kernel on the CPU: copy the bytes.
            k, v = (
                quantize_kv(k, k_scale).view(torch.uint8),
                quantize_kv(v, v_scale).view(torch.uint8),
            )
            key_cache.view(torch.uint8).index_copy_(0, meta.slot_mapping, k)
            value_cache.view(torch.uint8).index_copy_(0, meta.slot_mapping, v)
        else:
            key_cache.index_copy_(0, meta.slot_mapping, k)
            value_cache.index_copy_(0, meta.slot_mapping, v)
        bend = _Scores(scale * k_scale if fp8 else scale, sinks, logits_soft_cap)
        if is_whole(meta.groups):
            group = meta.groups[0]
            out = self._attend(q, key_cache, value_cache, group, group.view(sliding_window), bend)
        else:
            out = torch.empty_like(q)
            for group in meta.groups:
                view = group.view(sliding_window)
                group.scatter(out, self._attend(q, key_cache, value_cache, group, view, bend))
        return out * v_scale if fp8 and v_scale != 1.0 else out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: Group,
        view: KeyView,
        scores: _Scores,
    ) -> torch.Tensor:
        # index_select: advanced indexing costs ~10x more per call on CPU.
        qg = q if group.src_tokens is None else q.index_select(0, group.src_tokens)
        bg, lq = view.kv_slots.shape[0], group.num_queries
        qg = qg.view(bg, lq, q.shape[1], q.shape[2]).transpose(1, 2)
        slots = view.kv_slots.view(-1)
        kv_shape = (bg, -1, key_cache.shape[1], key_cache.shape[2])
        keys = key_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)  # [Bg, Hkv, Lkv, D]
        values = value_cache.index_select(0, slots).view(kv_shape).transpose(1, 2)
        # An fp8 cache's values convert exactly (e4m3 fits in every float dtype).
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if scores.sinks is None and scores.soft_cap is None:
            out = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=view.mask, scale=scores.scale, enable_gqa=True
            )
        else:
            out = _attend_explicitly(qg, keys, values, view.mask, scores)
        return out.transpose(1, 2).reshape(bg * lq, q.shape[1], q.shape[2])


@dataclass(frozen=True, slots=True)
class _Scores:
    """How a layer turns q.k into softmax logits: the scale, then the soft cap c (s becomes
    c * tanh(s / c)), then the mask; sinks [Hq] join each softmax's denominator."""

    scale: float
    sinks: torch.Tensor | None
    soft_cap: float | None


def _attend_explicitly(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    how: _Scores,
) -> torch.Tensor:
    """Attention of q [Bg, Hq, Lq, D] over keys/values [Bg, Hkv, Lkv, D] with the scores
    materialised: soft-capped (transformers' Gemma 2 eager attention) and with exp(sinks[h])
    counted in each row's denominator (its gpt-oss eager attention) where the layer has them:
    [Bg, Hq, Lq, D]."""
    bg, hq, lq, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(bg, hkv, hq // hkv * lq, d)  # a kv head's query heads, one after another
    scores = torch.matmul(qg, keys.transpose(2, 3)).view(bg, hq, lq, -1) * how.scale
    if how.soft_cap is not None:
        scores = torch.tanh(scores / how.soft_cap) * how.soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if how.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = how.sinks.to(scores.dtype).view(1, hq, 1, 1).expand(bg, hq, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(bg, hkv, hq // hkv * lq, -1), values)
    return out.view(bg, hq, lq, d)
