"""The quantization resolver: whether the linear weights stay GGUF-quantized, and the
settings the quantized path refuses."""

from __future__ import annotations

from collections.abc import Callable

from config.errors import ConfigError
from config.load import LoadConfig
from config.model import ModelConfig
from config.model_arch import ModelArchConfig

# Quantized checkpoint formats (config.json's quantization_config.quant_method) the loader reads,
# and the architectures it reads them for. Each is dequantized at load to the model's dtype (no
# kernel here computes in them): MXFP4, gpt-oss's experts (gpu_worker/loader/mxfp4.py).
CHECKPOINT_QUANTIZATIONS = {"mxfp4": ("GptOssForCausalLM",)}


def resolve_quantization(
    model: ModelConfig,
    load: LoadConfig,
    tensor_parallel_size: int,
    device_type: str,
    cpu_kernels_available: Callable[[], bool],
) -> str | None:
    """'gguf' when the linear weights stay GGUF-quantized, else None (ModelConfig.quantization);
    --load-format gguf asks for the same. Refuses what the quantized path cannot run. On
    the CPU activations are float32 (the C kernels); on CUDA they take the model's dtype
    (the Triton kernels dequantize into it)."""
    from config.default_model import names_gguf

    requested = "gguf" if load.load_format == "gguf" else model.quantization
    is_gguf = names_gguf(model.model)
    tp = tensor_parallel_size
    if requested is None:
        auto = (
            is_gguf
            and device_type == "cpu"
            and model.dtype == "auto"
            and tp == 1
            and load.load_format == "auto"
            and cpu_kernels_available()
        )
        return "gguf" if auto else None
    if not is_gguf:
        raise ConfigError(
            f"quantization 'gguf' needs a GGUF model (a .gguf file, a Hub GGUF repository's "
            f"org/name:QUANT or the default model), not {model.model!r}"
        )
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(
            f"GGUF quantized weights run on the CPU and on CUDA (there is no "
            f"{device_type} kernel for them): drop --quantization gguf and pass "
            f"--dtype bfloat16 or --dtype float32 to dequantize them at load"
        )
    if device_type == "cpu" and model.dtype not in ("auto", "float32", "float"):
        raise ConfigError(
            f"quantization 'gguf' computes in float32 on the CPU, not "
            f"{model.dtype}; drop --quantization to run dequantized weights in "
            f"{model.dtype}"
        )
    if tp > 1:
        raise ConfigError(
            f"GGUF quantized weights are not split across tensor-parallel ranks: "
            f"tensor_parallel_size {tp} needs dequantized weights (--dtype "
            f"float32, without --quantization gguf)"
        )
    if load.load_format not in ("auto", "gguf"):
        raise ConfigError(
            f"quantization 'gguf' loads the GGUF file, not load_format {load.load_format!r}"
        )
    if device_type == "cpu" and not cpu_kernels_available():
        raise ConfigError(
            "GGUF quantized weights need the C CPU kernels, which are not "
            "available here (no C compiler, or ENGINE_CPU_KERNELS=0)"
        )
    return "gguf"


def check_checkpoint_quantization(arch: ModelArchConfig, source: str = "config.json") -> None:
    """Refuse a checkpoint whose config.json says its weights are quantized in a format the
    loader does not read for its architecture (they would not load as dense weights); accepts
    gpt-oss's MXFP4 experts, which are dequantized at load."""
    qc = arch.hf_config.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    readers = CHECKPOINT_QUANTIZATIONS.get(str(method))
    known = "; ".join(f"{m} for {', '.join(a)}" for m, a in CHECKPOINT_QUANTIZATIONS.items())
    if readers is None:
        raise ConfigError(
            f"{source}: quantization_config quant_method {method!r} is not supported "
            f"(quantized checkpoints read: {known}, dequantized at load)"
        )
    if arch.architecture not in readers:
        raise ConfigError(
            f"{source}: quantization_config quant_method {method!r} is read only for "
            f"{', '.join(readers)}, not {arch.architecture}"
        )
