"""Architecture name (config.json 'architectures') -> model class."""

from __future__ import annotations

from torch import nn

from gpu_worker.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from gpu_worker.models.gemma2 import Gemma2ForCausalLM
from gpu_worker.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from gpu_worker.models.gpt_oss import GptOssForCausalLM
from gpu_worker.models.granite import GraniteForCausalLM
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.mixtral import MixtralForCausalLM
from gpu_worker.models.olmo2 import Olmo2ForCausalLM
from gpu_worker.models.phi3 import Phi3ForCausalLM
from gpu_worker.models.qwen2 import Qwen2ForCausalLM
from gpu_worker.models.qwen3 import Qwen3ForCausalLM
from gpu_worker.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    """The class for an architecture; refuses unknown ones, naming those that are supported."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"{source}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
