"""DeepSeek-V2 and DeepSeek-V3 (and R1): multi-head latent attention (deepseek_mla.py) and a
mixture of experts with shared experts.

The first first_k_dense_replace layers keep a dense gated MLP of intermediate_size; from there
every moe_layer_freq-th layer is sparse: a router `mlp.gate` (fp32, [E, H]) picks each token's
num_experts_per_tok of the n_routed_experts experts (moe_intermediate_size each, at
`mlp.experts`), and n_shared_experts * moe_intermediate_size of shared gated MLP
(`mlp.shared_experts`) runs for every token. V2 scores with a softmax and picks greedily or
within the topk_group best of n_group groups (a group's score: its best expert); V3 scores with
a sigmoid, steers the choice with e_score_correction_bias and picks within the best groups (a
group's score: the sum of its best two), renormalises (norm_topk_prob) and multiplies by
routed_scaling_factor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from config.mla_arch import MLAConfig
from config.model_arch import ModelArchConfig
from config.moe_arch import DeepseekMoEConfig
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.models.blocks import GatedMLP
from gpu_worker.models.decoder import DecoderForCausalLM, Weights
from gpu_worker.models.deepseek_mla import DeepseekMLA
from gpu_worker.models.moe_block import unstack_experts
from gpu_worker.models.weights import GATED_EXPERTS, StackedShard


class DeepseekRouter(nn.Module):
    """`mlp.gate`: router logits [T, E] in fp32 from a weight kept in fp32, as transformers
    keeps it; with correction_bias, V3's e_score_correction_bias [E], which steers the choice
    only (FusedMoE adds it to the scores for choosing)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """x [T, H] -> routed experts' weighted sum plus the shared experts' output [T, H]."""

    def __init__(self, hidden_size: int, moe: DeepseekMoEConfig) -> None:
        super().__init__()
        assert moe.routing is not None  # a sparse layer's model has experts
        self.gate = DeepseekRouter(hidden_size, moe.num_experts, moe.correction_bias)
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.intermediate_size, moe.routing)
        self.shared_experts = (
            GatedMLP(hidden_size, moe.intermediate_size * moe.num_shared_experts)
            if moe.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x), self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (softmax routing, interleaved rope)."""

    version: Literal[2, 3] = 2
    # Only the MLPs' projections are fused; MLA's are loaded as they are.
    stacked_shards = (
        StackedShard("gate_up_proj", "gate_proj", 0),
        StackedShard("gate_up_proj", "up_proj", 1),
    )
    expert_shards = GATED_EXPERTS

    def __init__(self, cfg: ModelArchConfig) -> None:
        self.mla = MLAConfig.from_hf(cfg.hf_config)
        self.moe = DeepseekMoEConfig.from_hf(cfg.hf_config, self.version)
        super().__init__(cfg)

    # Not a SelfAttention, but called as one (x, rotary, cos, sin) with its Attention at .attn,
    # which is all DecoderLayer and attention_layers() use.
    def attention_block(  # type: ignore[override]
        self, cfg: ModelArchConfig, layer_idx: int
    ) -> DeepseekMLA:
        return DeepseekMLA(cfg, self.mla)

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        if not self.moe.is_sparse(layer_idx):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return DeepseekMoE(cfg.hidden_size, self.moe)

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        layers = _model_layers_only(weights, self.cfg.num_hidden_layers)
        return unstack_experts(layers, "gate_proj", "up_proj", "down_proj")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (sigmoid routing with the correction bias, rope_interleave)."""

    version = 3


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _model_layers_only(
    weights: Weights, num_layers: int
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoint without the layers past num_hidden_layers: V3's multi-token-prediction
    module (model.layers.61 of DeepSeek-V3), which transformers ignores as well."""
    for source, name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match[1]) < num_layers:
            yield source, name, tensor
