"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache, in plain torch ops.

The cache keeps ONE vector per token and layer, [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim
elements), never per-head keys and values. The model attends in the absorbed form
(gpu_worker/models/deepseek_mla.py): each query head's no-rope part is taken through W_UK into
latent space, so attention is multi-query attention with one KV head whose keys are the cached
vectors and whose values are their latent part c_kv; W_UV then maps the result back per head.

A step is planned on the host as the torch backend plans one (host_plan.py): decodes and
prefill chunks in two groups, each group's gather indices and causal mask built once a step
and read by every layer. It runs on the CPU and on CUDA alike; planning on the host keeps it
out of CUDA graphs (supports_cuda_graphs stays False: the runner then runs every step eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from config.attention import attention_support
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.host_plan import Group, is_whole, plan_step
from gpu_worker.attention.metadata import DeviceBatch, StepBatch


@dataclass(slots=True)
class MLAMetadata:
    """Per-step metadata: the slots this step writes, and its groups (decodes, prefill chunks)."""

    slot_mapping: torch.Tensor  # [T]
    groups: list[Group]


def check_latent_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless k is one latent vector per token [T, 1, L] and v is no wider than
    it (its leading part, c_kv): the contract of both MLA backends' forward."""
    if k.shape[1] != 1 or v.shape[-1] > k.shape[-1]:
        raise ValueError(
            f"latent attention takes one latent vector per token and its leading part as "
            f"values; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


class MLATorchBackend(AttentionBackend[MLAMetadata]):
    """Latent-cache attention; forward()'s k is the step's latent vectors, v their c_kv part."""

    name = "mla_torch"
    support = attention_support(name)
    plans_on_host = True  # build() reads the step's host arrays (StepBatch)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """[num_blocks, block_size, latent]: the runner asks for one KV head of the latent
        vector's size (gpu_worker/kv_cache.py)."""
        if num_kv_heads != 1:
            raise ValueError(f"a latent (MLA) cache has one vector per token, not {num_kv_heads}")
        return (num_blocks, block_size, head_dim)

    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> MLAMetadata:
        """Gather indices and masks for the whole step, decodes and prefill chunks apart (a
        long chunk does not pad every decode to its length)."""
        assert step is not None, "plans_on_host: the runner hands in the host arrays"
        return MLAMetadata(device_batch.slot_mapping, plan_step(step, device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: MLAMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [T, H, L] the absorbed queries ([q_nope W_UK | q_pe]); k: [T, 1, L] this step's
        latent vectors [c_kv | k_pe], written into the cache at the slots; v: k's first Dv
        elements (c_kv), which the cache already holds, so it is not written. Returns [T, H, Dv],
        each head's attention-weighted sum of its context's c_kv."""
        assert sliding_window is None and sinks is None and logits_soft_cap is None, (
            "the MLA backend's support has none of them"
        )
        assert k_scale == v_scale == 1.0, "an fp8 KV cache is refused with MLA (no scales)"
        check_latent_kv(k, v)
        cache = kv_cache.view(-1, kv_cache.shape[-1])
        cache.index_copy_(0, meta.slot_mapping, k[:, 0])
        value_dim = v.shape[-1]
        out = None if is_whole(meta.groups) else q.new_empty(q.shape[0], q.shape[1], value_dim)
        for group in meta.groups:
            qg = q if group.src_tokens is None else q.index_select(0, group.src_tokens)
            view = group.view()
            rows = latent_attention(
                qg, cache, view.kv_slots, view.mask, group.num_queries, scale, value_dim
            )
            if out is None:
                return rows
            group.scatter(out, rows)
        assert out is not None  # a step has at least one group
        return out


def latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_slots: torch.Tensor,
    mask: torch.Tensor | None,
    num_queries: int,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Attention of a group's padded query rows q [Bg * Lq, H, L] over the latent vectors at
    kv_slots [Bg, Lkv] of cache [slots, L], values their first value_dim elements, where mask
    [Bg, 1, Lq, Lkv] allows (None: everywhere): [Bg * Lq, H, value_dim]. Every head of a request
    scores the same vectors, so the heads are stacked as the query rows of one matmul."""
    bg, lq = kv_slots.shape[0], num_queries
    heads, latent = q.shape[1], q.shape[2]
    qg = q.view(bg, lq, heads, latent).transpose(1, 2).reshape(bg, heads * lq, latent)
    ctx = cache.index_select(0, kv_slots.view(-1)).view(bg, -1, latent)  # [Bg, Lkv, L]
    scores = torch.bmm(qg, ctx.transpose(1, 2)).float().mul_(scale).view(bg, heads, lq, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(bg, heads * lq, -1)
    out = torch.bmm(probs, ctx[..., :value_dim])  # [Bg, H * Lq, Dv]
    return out.view(bg, heads, lq, value_dim).transpose(1, 2).reshape(bg * lq, heads, value_dim)
