"""Mixtral (8x7B, 8x22B): Llama's attention without biases, the window config.json's
sliding_window gives (every layer; null in the released checkpoints), and in every layer a
mixture of experts at `block_sparse_moe` (the decoder layer's `mlp` here): router `gate`
[E, H] without bias, softmax over the experts, the top num_experts_per_tok renormalised;
experts `experts.<e>.w1|w3|w2` (gate, up, down) of intermediate_size.

The Hub's checkpoints (and transformers 5's save_pretrained) name the block block_sparse_moe;
transformers 5 calls it mlp inside the model, with the experts stacked
(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]), which is what
save_pretrained(save_original_format=False) writes: both load."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from config.moe_arch import MixtralMoeConfig, MoERouting
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM, Weights
from gpu_worker.models.moe_block import SparseMoeBlock, unstack_experts
from gpu_worker.models.weights import ExpertShard

# Mixtral's expert projections: w1 gate, w3 up, w2 down.
MIXTRAL_EXPERTS = (
    ExpertShard("w1", "gate"),
    ExpertShard("w3", "up"),
    ExpertShard("w2", "down"),
)


class MixtralForCausalLM(DecoderForCausalLM):
    expert_shards = MIXTRAL_EXPERTS

    def __init__(self, cfg: ModelArchConfig) -> None:
        self.moe = MixtralMoeConfig.from_hf(cfg.hf_config)
        super().__init__(cfg)

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg, qkv_bias=False, o_bias=False, sliding_window=cfg.layer_sliding_window(layer_idx)
        )

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            cfg.hidden_size,
            self.moe.num_local_experts,
            self.moe.intermediate_size,
            MoERouting(top_k=self.moe.num_experts_per_tok, renormalize=True),
        )

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        return unstack_experts(_as_module_names(weights), "w1", "w3", "w2")


def _as_module_names(weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoints' block_sparse_moe is the decoder layer's mlp (as transformers 5 renames
    it on loading)."""
    for source, name, tensor in weights:
        yield source, name.replace(".block_sparse_moe.", ".mlp."), tensor
