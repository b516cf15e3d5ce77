"""Each model family's own config.json fields, checked when the configuration resolves: a
family's parser (config/moe_arch.py, config/mla_arch.py) refuses what its model class cannot
build, and the experts must split over the tensor-parallel ranks as FusedMoE splits them, so
that the refusal is one line before any process starts instead of an error in the engine core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from config.dense_arch import check_granite, check_olmo2
from config.errors import ConfigError
from config.gemma_arch import check_gemma
from config.mla_arch import MLAConfig
from config.model_arch import ModelArchConfig
from config.moe_arch import (
    DeepseekMoEConfig,
    ExpertShape,
    GptOssMoeConfig,
    MixtralMoeConfig,
    Qwen3MoeConfig,
)
from config.parallel import ParallelConfig
from config.phi3_arch import check_phi3


def _deepseek(version: int) -> Callable[[dict[str, Any]], ExpertShape | None]:
    def parse(cfg: dict[str, Any]) -> ExpertShape | None:
        MLAConfig.from_hf(cfg)
        return DeepseekMoEConfig.from_hf(cfg, 2 if version == 2 else 3).experts()

    return parse


# Architecture -> its family's parser of config.json: the experts' shape (None: no experts),
# ValueError naming the field the model class would refuse.
FAMILY_PARSERS: dict[str, Callable[[dict[str, Any]], ExpertShape | None]] = {
    "Qwen3MoeForCausalLM": lambda cfg: Qwen3MoeConfig.from_hf(cfg).experts(),
    "MixtralForCausalLM": lambda cfg: MixtralMoeConfig.from_hf(cfg).experts(),
    "GptOssForCausalLM": lambda cfg: GptOssMoeConfig.from_hf(cfg).experts(),
    "DeepseekV2ForCausalLM": _deepseek(2),
    "DeepseekV3ForCausalLM": _deepseek(3),
    "Gemma2ForCausalLM": check_gemma("Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": check_gemma("Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": check_gemma("Gemma3ForConditionalGeneration"),
    "GraniteForCausalLM": check_granite,
    "Olmo2ForCausalLM": check_olmo2,
    "Phi3ForCausalLM": check_phi3,
}


def check_family_config(
    arch: ModelArchConfig, parallel: ParallelConfig, model_name: str = "the model"
) -> None:
    """Raise ConfigError (one line naming the model, config.json and the field) when the
    family's own fields are ones its model class refuses, or its experts do not divide over
    tensor_parallel_size ranks: each expert's intermediate columns (moe_intermediate_size,
    or intermediate_size where the family's experts use it), or with enable_expert_parallel the
    experts themselves."""
    parse = FAMILY_PARSERS.get(arch.architecture)
    if parse is None:
        return
    where = f"model {model_name} ({arch.architecture})"
    try:
        experts = parse(arch.hf_config)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    tp = parallel.tensor_parallel_size
    if experts is None and arch.intermediate_size % tp:
        # A dense family parsed here: every gated MLP splits intermediate_size over the ranks
        # (config/engine.py checks the families without a parser).
        raise ConfigError(
            f"{where}: config.json's intermediate_size ({arch.intermediate_size}) is not "
            f"divisible by tensor_parallel_size {tp}"
        )
    if experts is None or tp == 1:
        return
    if parallel.enable_expert_parallel:
        if experts.num_experts % tp:
            raise ConfigError(
                f"{where}: enable_expert_parallel places whole experts on the "
                f"{tp} tensor-parallel ranks, but config.json's {experts.num_experts} experts "
                f"do not divide evenly over them"
            )
    elif experts.intermediate_size % tp:
        raise ConfigError(
            f"{where}: config.json's expert width ({experts.intermediate_size}, "
            f"moe_intermediate_size or intermediate_size) is not divisible by "
            f"tensor_parallel_size {tp}; use a size that divides it, or enable_expert_parallel"
        )
