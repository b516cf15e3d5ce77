"""The mixture-of-experts fields of each family's config.json, parsed and checked without torch,
so that the configuration refuses what the engine cannot run when it resolves
(config/family_arch.py) and the model files (gpu_worker/models/) build from the same objects.

Every parser reads a field as transformers' config class does, its default included
(config/hf_defaults.py), and raises ValueError naming config.json and the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from config.hf_defaults import filled


@dataclass(frozen=True, slots=True)
class MoERouting:
    """How router logits [T, E] become each token's top_k experts and their weights
    (gpu_worker/layers/moe_routing.py's select_experts applies it)."""

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    # Divide each token's chosen weights by their sum.
    renormalize: bool = True
    # Grouped top-k (DeepSeek): experts in num_groups equal groups, a token picks among the
    # experts of its topk_groups best groups; a group's score is its best expert's ("max", V2)
    # or the sum of its best two ("top2_sum", V3, bias included).
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    # Every chosen weight is multiplied by it (after renormalising).
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be at least 1, not {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_group ({self.topk_groups}) must be between 1 and n_group ({self.num_groups})"
            )


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """What the experts' layer (FusedMoE) splits over the ranks: E experts of I columns each,
    top_k of them per token."""

    num_experts: int
    intermediate_size: int
    top_k: int


def config_int(cfg: Mapping[str, Any], *names: str, minimum: int = 0) -> int:
    """The integer config.json gives under the first of names present; ValueError naming
    config.json and the field when none is, or it is not an integer >= minimum."""
    name = next((n for n in names if cfg.get(n) is not None), None)
    if name is None:
        raise ValueError(
            f"config.json: missing field {names[0]!r} ({cfg.get('architectures', ['?'])[0]} "
            f"needs it)"
        )
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"config.json: field {name!r} must be an integer >= {minimum}, not {value!r}"
        )
    return value


def require_silu(cfg: Mapping[str, Any]) -> None:
    """The experts compute SwiGLU (silu(gate) * up); refuse another hidden_act."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"config.json: hidden_act {act!r} is not supported for the experts (only 'silu')"
        )


def _or(value: Any, default: Any) -> Any:
    """value, or default where config.json gives null."""
    return default if value is None else value


def _check_top_k(top_k: int, num_experts: int) -> None:
    if top_k > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok ({top_k}) exceeds the number of experts "
            f"({num_experts})"
        )


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
        cfg = filled(cfg, "qwen3_moe")
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
        top_k = config_int(cfg, "num_experts_per_tok", minimum=1) if sparse else 0
        _check_top_k(top_k, num_experts)
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=(
                config_int(cfg, "moe_intermediate_size", minimum=1) if sparse else 0
            ),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=config_int(cfg, "decoder_sparse_step", minimum=1),
            mlp_only_layers=frozenset(only),
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer layer_idx has the experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def experts(self) -> ExpertShape | None:
        """The experts' shape; None when no layer has experts."""
        if not self.num_experts:
            return None
        return ExpertShape(self.num_experts, self.moe_intermediate_size, self.num_experts_per_tok)


@dataclass(frozen=True, slots=True)
class MixtralMoeConfig:
    """The mixture-of-experts fields of a Mixtral config.json (the experts' width is
    intermediate_size)."""

    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MixtralMoeConfig:
        """Parse config.json; ValueError naming the field that is missing or invalid."""
        cfg = filled(cfg, "mixtral")
        require_silu(cfg)
        experts = config_int(cfg, "num_local_experts", "num_experts", minimum=1)
        top_k = config_int(cfg, "num_experts_per_tok", minimum=1)
        _check_top_k(top_k, experts)
        return cls(experts, top_k, config_int(cfg, "intermediate_size", minimum=1))

    def experts(self) -> ExpertShape:
        return ExpertShape(self.num_local_experts, self.intermediate_size, self.num_experts_per_tok)


# The clamped SwiGLU's sigmoid gain kernels/fused_moe.py computes ("swigluoai").
SWIGLU_ALPHA = 1.702


@dataclass(frozen=True, slots=True)
class GptOssMoeConfig:
    """The mixture-of-experts fields of a gpt-oss config.json (the experts' width is
    intermediate_size)."""

    num_local_experts: int
    num_experts_per_tok: int
    swiglu_limit: float | None
    intermediate_size: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GptOssMoeConfig:
        """Parse config.json; ValueError naming a field that is missing, invalid or a value the
        experts' kernel does not compute."""
        cfg = filled(cfg, "gpt_oss")
        alpha = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA))
        if alpha != SWIGLU_ALPHA:
            raise ValueError(
                f"config.json: swiglu_alpha {alpha} is not supported (the experts' kernel "
                f"computes gpt-oss's {SWIGLU_ALPHA})"
            )
        limit = cfg.get("swiglu_limit")
        experts = config_int(cfg, "num_local_experts", "num_experts", minimum=1)
        top_k = config_int(cfg, "num_experts_per_tok", "experts_per_token", minimum=1)
        _check_top_k(top_k, experts)
        return cls(
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            swiglu_limit=None if limit is None else float(limit),
            intermediate_size=config_int(cfg, "intermediate_size", minimum=1),
        )

    def experts(self) -> ExpertShape:
        return ExpertShape(self.num_local_experts, self.intermediate_size, self.num_experts_per_tok)


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
        """Parse config.json as transformers' DeepseekV2Config / DeepseekV3Config reads it
        (their defaults where a field is left out); ValueError naming the field that is
        missing, invalid or not supported."""
        cfg = filled(cfg, f"deepseek_v{version}")
        require_silu(cfg)
        num_experts = int(cfg.get("n_routed_experts") or 0)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
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
            renormalize=bool(cfg.get("norm_topk_prob")),
            num_groups=groups,
            topk_groups=topk_groups,
            group_score="max" if version == 2 else "top2_sum",
            routed_scaling_factor=float(_or(cfg.get("routed_scaling_factor"), 1.0)),
        )
        return cls(
            num_experts=num_experts,
            first_dense_layers=first_dense,
            layer_freq=config_int(cfg, "moe_layer_freq", minimum=1)
            if "moe_layer_freq" in cfg
            else 1,
            intermediate_size=config_int(cfg, "moe_intermediate_size", minimum=1),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
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

    def experts(self) -> ExpertShape | None:
        """The routed experts' shape; None when every layer is dense."""
        if self.routing is None:
            return None
        return ExpertShape(self.num_experts, self.intermediate_size, self.routing.top_k)
