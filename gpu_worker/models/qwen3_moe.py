"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on each head of q and
k) and, in the layers transformers makes sparse, a mixture of experts: a router `mlp.gate`
[E, H] without bias, softmax over the experts, the top num_experts_per_tok, renormalised when
norm_topk_prob; the experts' gated MLPs of moe_intermediate_size at `mlp.experts`. The other
layers keep the dense gated MLP of intermediate_size."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from config.moe_arch import MoERouting, Qwen3MoeConfig
from gpu_worker.models.blocks import GatedMLP, SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM, Weights
from gpu_worker.models.moe_block import SparseMoeBlock, unstack_experts
from gpu_worker.models.weights import GATED_EXPERTS


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    expert_shards = GATED_EXPERTS

    def __init__(self, cfg: ModelArchConfig) -> None:
        self.moe = Qwen3MoeConfig.from_hf(cfg.hf_config)
        super().__init__(cfg)

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=True,
        )

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        moe = self.moe
        if not moe.is_sparse(layer_idx):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        routing = MoERouting(top_k=moe.num_experts_per_tok, renormalize=moe.norm_topk_prob)
        return SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.moe_intermediate_size, routing)

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        return unstack_experts(weights, "gate_proj", "up_proj", "down_proj")
