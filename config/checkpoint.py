"""What a model directory must hold for the engine to run it, checked when the configuration
resolves (in the launcher or LLM, before any process starts): an architecture the engine
implements and weights in a format it loads (config/quantization.py checks the checkpoint's
quantization_config). Each refusal is one line naming the model, what is unsupported and what is.

The model classes live in gpu_worker/models/registry.py, which this leaf package cannot import;
SUPPORTED_ARCHITECTURES lists the same names (a test holds the two equal).
"""

from __future__ import annotations

from pathlib import Path

from config.errors import ConfigError
from config.model_arch import ModelArchConfig

SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "GptOssForCausalLM",
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


def check_checkpoint(
    model_path: str, arch: ModelArchConfig, load_format: str, name: str | None = None
) -> None:
    """Raise ConfigError when the engine cannot run the model in model_path; name: the model as
    messages call it (default: the folder's name; a Hub id's folder is its commit)."""
    name = name or Path(model_path).name or model_path
    if arch.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"model {name}: architecture {arch.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if load_format in ("auto", "safetensors"):
        folder = Path(model_path)
        if not any(folder.glob("*.safetensors")):
            others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt")
            )
            found = (
                f" (found {', '.join(others[:3])}: PyTorch pickles are not loaded)"
                if others
                else ""
            )
            raise ConfigError(
                f"model {name}: no *.safetensors weights in {folder}{found}; the engine loads "
                f"safetensors checkpoints and GGUF files (--load-format dummy for random weights)"
            )
