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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.moe_routing import MoERouting
from gpu_worker.models.blocks import GatedMLP
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.deepseek_mla import DeepseekMLA, MLAConfig
from gpu_worker.models.moe_block import config_int, require_silu, unstack_experts
from gpu_worker.models.weights import GATED_EXPERTS, StackedShard, load_named_weights

_V2_DEFAULTS: dict[str, Any] = dict(
    n_routed_experts=64,
    first_k_dense_replace=0,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    n_shared_experts=2,
)
_V3_DEFAULTS: dict[str, Any] = dict(
    n_routed_experts=256,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
)


@dataclass(frozen=True, slots=True)
class DeepseekMoEConfig:
    """Where a DeepSeek model's experts are and how it routes to them."""

    num_experts: int  # 0: every layer dense
    first_dense_layers: int
    layer_freq: int
    intermediate_size: int
    num_shared_experts: int
    routing: MoERouting | None
    correction_bias: bool  # V3: the router's e_score_correction_bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], version: Literal[2, 3]) -> DeepseekMoEConfig:
        """Parse config.json as transformers' DeepseekV2Config / DeepseekV3Config reads it;
        ValueError naming the field that is missing, invalid or not supported."""
        require_silu(cfg)
        # transformers' defaults where config.json leaves a field out.
        defaults = _V2_DEFAULTS if version == 2 else _V3_DEFAULTS
        num_experts = int(cfg.get("n_routed_experts", defaults["n_routed_experts"]) or 0)
        first_dense = int(cfg.get("first_k_dense_replace", defaults["first_k_dense_replace"]) or 0)
        if not num_experts:
            return cls(0, first_dense, 1, 0, 0, None, False)
        scoring: Literal["softmax", "sigmoid"] = "softmax" if version == 2 else "sigmoid"
        if cfg.get("scoring_func", scoring) != scoring:
            raise ValueError(
                f"config.json: scoring_func {cfg['scoring_func']!r} is not supported for "
                f"DeepSeek-V{version} (it scores with {scoring})"
            )
        method = cfg.get("topk_method") or ("greedy" if version == 2 else "noaux_tc")
        methods = ("greedy", "group_limited_greedy") if version == 2 else ("noaux_tc",)
        if method not in methods:
            raise ValueError(
                f"config.json: topk_method {method!r} is not supported for DeepSeek-V{version} "
                f"(supported: {', '.join(methods)})"
            )
        grouped = method != "greedy"
        groups = int(cfg.get("n_group") or 1) if grouped else 1
        topk_groups = int(cfg.get("topk_group") or 1) if grouped else 1
        top_k = config_int(cfg, "num_experts_per_tok", minimum=1)
        if num_experts % groups:
            raise ValueError(
                f"config.json: n_routed_experts ({num_experts}) is not divisible by n_group "
                f"({groups})"
            )
        if top_k > topk_groups * (num_experts // groups):
            # transformers would then pick experts of masked groups (with weight 0 in V2).
            raise ValueError(
                f"config.json: num_experts_per_tok ({top_k}) exceeds the experts of the "
                f"topk_group ({topk_groups}) groups a token chooses from"
            )
        routing = MoERouting(
            top_k=top_k,
            scoring=scoring,
            # transformers' V2 router never renormalises; DeepSeek's own code and vLLM do when
            # norm_topk_prob, which every released V2 config leaves false.
            renormalize=bool(cfg.get("norm_topk_prob", defaults["norm_topk_prob"])),
            num_groups=groups,
            topk_groups=topk_groups,
            group_score="max" if version == 2 else "top2_sum",
            routed_scaling_factor=float(
                cfg.get("routed_scaling_factor", defaults["routed_scaling_factor"])
            ),
        )
        return cls(
            num_experts=num_experts,
            first_dense_layers=first_dense,
            layer_freq=config_int(cfg, "moe_layer_freq", minimum=1)
            if "moe_layer_freq" in cfg
            else 1,
            intermediate_size=config_int(cfg, "moe_intermediate_size", minimum=1),
            num_shared_experts=int(cfg.get("n_shared_experts", defaults["n_shared_experts"]) or 0),
            routing=routing,
            correction_bias=version == 3,
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer layer_idx has the experts (vLLM's rule; transformers reads no
        moe_layer_freq, which is 1 in every released config)."""
        return (
            self.num_experts > 0
            and layer_idx >= self.first_dense_layers
            and layer_idx % self.layer_freq == 0
        )


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

    def load_weights(self, weights: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        tied = self.cfg.tie_word_embeddings
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        weights = unstack_experts(
            _model_layers_only(weights, self.cfg.num_hidden_layers),
            "gate_proj",
            "up_proj",
            "down_proj",
        )
        load_named_weights(self, weights, self.stacked_shards, skip, experts=GATED_EXPERTS)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (sigmoid routing with the correction bias, rope_interleave)."""

    version = 3


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _model_layers_only(
    weights: Iterable[tuple[str, str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoint without the layers past num_hidden_layers: V3's multi-token-prediction
    module (model.layers.61 of DeepSeek-V3), which transformers ignores as well."""
    for source, name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match[1]) < num_layers:
            yield source, name, tensor
