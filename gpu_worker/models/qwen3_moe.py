"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on each head of q and
k) and, in the layers transformers makes sparse, a mixture of experts: a router `mlp.gate`
[E, H] without bias, softmax over the experts, the top num_experts_per_tok, renormalised when
norm_topk_prob; the experts' gated MLPs of moe_intermediate_size at `mlp.experts`. The other
layers keep the dense gated MLP of intermediate_size."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.moe_routing import MoERouting
from gpu_worker.models.blocks import GatedMLP, SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.moe_block import SparseMoeBlock, config_int, require_silu, unstack_experts
from gpu_worker.models.weights import GATED_EXPERTS, load_named_weights


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig:
    """The mixture-of-experts fields of a Qwen3-MoE config.json, with transformers' defaults."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3MoeConfig:
        """Parse config.json; ValueError naming the field that is missing or invalid.
        transformers 5 writes num_experts as num_local_experts."""
        require_silu(cfg)
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            # transformers slides every layer of a Qwen3-MoE then (max_window_layers is not
            # read), which config/model_arch.py's Qwen rule does not describe.
            raise ValueError(
                "config.json: use_sliding_window is not supported for Qwen3-MoE (no released "
                "checkpoint sets it)"
            )
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise ValueError(
                f"config.json: field 'mlp_only_layers' must be a list of layer indices, "
                f"not {only!r}"
            )
        num_experts = config_int(cfg, "num_experts", "num_local_experts")
        sparse = num_experts > 0
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=config_int(cfg, "num_experts_per_tok", minimum=1) if sparse else 0,
            moe_intermediate_size=(
                config_int(cfg, "moe_intermediate_size", minimum=1) if sparse else 0
            ),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=(
                config_int(cfg, "decoder_sparse_step", minimum=1)
                if "decoder_sparse_step" in cfg
                else 1
            ),
            mlp_only_layers=frozenset(only),
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer layer_idx has the experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
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

    def load_weights(self, weights: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        tied = self.cfg.tie_word_embeddings
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        weights = unstack_experts(weights, "gate_proj", "up_proj", "down_proj")
        load_named_weights(self, weights, self.stacked_shards, skip, experts=GATED_EXPERTS)
