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

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.moe_routing import MoERouting
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.moe_block import SparseMoeBlock, config_int, require_silu, unstack_experts
from gpu_worker.models.weights import ExpertShard, load_named_weights

# Mixtral's expert projections: w1 gate, w3 up, w2 down.
MIXTRAL_EXPERTS = (
    ExpertShard("w1", "gate"),
    ExpertShard("w3", "up"),
    ExpertShard("w2", "down"),
)


@dataclass(frozen=True, slots=True)
class MixtralMoeConfig:
    """The mixture-of-experts fields of a Mixtral config.json."""

    num_local_experts: int
    num_experts_per_tok: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MixtralMoeConfig:
        """Parse config.json; ValueError naming the field that is missing or invalid."""
        require_silu(cfg)
        return cls(
            num_local_experts=config_int(cfg, "num_local_experts", "num_experts", minimum=1),
            num_experts_per_tok=config_int(cfg, "num_experts_per_tok", minimum=1),
        )


class MixtralForCausalLM(DecoderForCausalLM):
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
            cfg.intermediate_size,
            MoERouting(top_k=self.moe.num_experts_per_tok, renormalize=True),
        )

    def load_weights(self, weights: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        tied = self.cfg.tie_word_embeddings
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        weights = unstack_experts(_as_module_names(weights), "w1", "w3", "w2")
        load_named_weights(self, weights, self.stacked_shards, skip, experts=MIXTRAL_EXPERTS)


def _as_module_names(
    weights: Iterable[tuple[str, str, torch.Tensor]],
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoints' block_sparse_moe is the decoder layer's mlp (as transformers 5 renames
    it on loading)."""
    for source, name, tensor in weights:
        yield source, name.replace(".block_sparse_moe.", ".mlp."), tensor
