"""The quantization resolver: which quantized method the linear weights run (GGUF, or a GPTQ,
AWQ or FP8 checkpoint's scheme, or FP8 quantized at load), and the settings each refuses.

A checkpoint's config.json quantization_config becomes a QuantScheme (quant_scheme), read the
same way here at configuration time and by the loader (gpu_worker/loader/
quantized_checkpoint.py): every feature the loader cannot read is refused here, before any
process starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError
from config.load import LoadConfig
from config.model import ModelConfig
from config.model_arch import ModelArchConfig

# Quantized checkpoint formats (config.json's quantization_config.quant_method) the loader reads
# dequantized at load to the model's dtype, and the architectures it reads them for: MXFP4,
# gpt-oss's experts (gpu_worker/loader/mxfp4.py).
CHECKPOINT_QUANTIZATIONS = {"mxfp4": ("GptOssForCausalLM",)}
# quant_method values whose linear weights the loader keeps quantized (QuantScheme), any
# architecture with the engine's Linear layers; "fp8" is also --quantization fp8 on a dense one.
SCHEME_METHODS = ("gptq", "awq", "compressed-tensors", "modelopt", "fbgemm_fp8", "fp8")
# config.json keys that make a model a mixture of experts (its experts are not Linear layers).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
INT_GROUP_ALIGN = 32  # the CPU kernels' blocks: a group spans whole 32-column blocks


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint's linear weights are quantized, in the engine's two canonical forms
    (kernels/quant_weights.py): 'int' (IntWeight) or 'fp8' (Fp8Weight)."""

    method: str  # "int" | "fp8"
    source: str  # the quant_method: gptq, awq, compressed-tensors, modelopt, fbgemm_fp8, fp8
    bits: int = 8
    group_size: int = -1  # inputs per scale; -1: one group per output row
    sym: bool = True  # int: no zero points (GPTQ's sym, compressed-tensors' symmetric)
    desc_act: bool = False  # GPTQ act-order: g_idx orders the groups
    checkpoint_format: str = ""  # GPTQ: "gptq" (zeros stored minus one) or "gptq_v2"
    weight_per_channel: bool = True  # fp8: a scale per output row (else one per tensor)
    activation_dynamic: bool = True  # fp8: activations scaled per token at run time
    weight_only: bool = False  # fp8: the checkpoint quantizes no activations (W8A16)
    ignore: tuple[str, ...] = ()  # module names left dense ("re:" regex or fnmatch patterns)
    quantize_at_load: bool = False  # the checkpoint is dense (--quantization fp8, dummy weights)


def _int(qc: dict[str, Any], *keys: str, default: int) -> int:
    for key in keys:
        if qc.get(key) is not None:
            return int(qc[key])
    return default


def _check_int(source: str, bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ConfigError(f"{source}: {bits}-bit weights are not supported (4 and 8 bits are)")
    if group_size != -1 and (group_size <= 0 or group_size % INT_GROUP_ALIGN):
        raise ConfigError(
            f"{source}: group_size {group_size} is not supported: the CPU kernels read groups "
            f"of whole {INT_GROUP_ALIGN}-column blocks (a multiple of {INT_GROUP_ALIGN}, or -1)"
        )


def _gptq(qc: dict[str, Any]) -> QuantScheme:
    bits, group = _int(qc, "bits", default=4), _int(qc, "group_size", default=128)
    _check_int("gptq", bits, group)
    fmt = str(qc.get("checkpoint_format") or "gptq")
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(
            f"gptq: checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r} is "
            f"not read (gptq and gptq_v2 are)"
        )
    if qc.get("dynamic"):
        raise ConfigError("gptq: per-module 'dynamic' overrides of bits/group_size are not read")
    return QuantScheme(
        "int",
        "gptq",
        bits,
        group,
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        checkpoint_format=fmt,
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _awq(qc: dict[str, Any]) -> QuantScheme:
    bits = _int(qc, "bits", "w_bit", default=4)
    group = _int(qc, "group_size", "q_group_size", default=128)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"awq: version {version!r} is not read (the GEMM layout is)")
    if bits != 4:
        raise ConfigError(f"awq: {bits}-bit weights are not supported (AWQ's GEMM layout is 4-bit)")
    if not qc.get("zero_point", True):
        raise ConfigError("awq: zero_point false is not read (AWQ's GEMM checkpoints have zeros)")
    _check_int("awq", bits, group)
    return QuantScheme(
        "int", "awq", bits, group, sym=False, ignore=tuple(qc.get("modules_to_not_convert") or ())
    )


def _compressed_tensors(qc: dict[str, Any]) -> QuantScheme:
    if qc.get("sparsity_config"):
        raise ConfigError("compressed-tensors: sparse checkpoints (sparsity_config) are not read")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ConfigError("compressed-tensors: quantization_config has no config_groups")
    if any(g != groups[0] for g in groups[1:]):
        raise ConfigError(
            "compressed-tensors: config_groups with different schemes are not read (one "
            "scheme for every quantized Linear)"
        )
    group = groups[0]
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    ignore = tuple(qc.get("ignore") or ())
    kind, bits = weights.get("type"), int(weights.get("num_bits", 0))
    strategy = weights.get("strategy")
    if kind == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise ConfigError(
                f"compressed-tensors: fp8 weights with strategy {strategy!r} are not read "
                f"(block-wise fp8 is not supported; tensor and channel are)"
            )
        if weights.get("dynamic"):
            raise ConfigError("compressed-tensors: dynamically quantized weights are not read")
        weight_only = acts is None
        if not weight_only:
            if acts.get("type") != "float" or int(acts.get("num_bits", 0)) != 8:
                raise ConfigError(
                    f"compressed-tensors: input activations {acts.get('type')} "
                    f"{acts.get('num_bits')}-bit are not supported (fp8 are)"
                )
            dynamic = bool(acts.get("dynamic"))
            if (dynamic, acts.get("strategy")) not in ((True, "token"), (False, "tensor")):
                raise ConfigError(
                    f"compressed-tensors: {'dynamic' if dynamic else 'static'} activation "
                    f"scales per {acts.get('strategy')!r} are not supported (dynamic per "
                    f"token or static per tensor are)"
                )
        return QuantScheme(
            "fp8",
            "compressed-tensors",
            8,
            weight_per_channel=strategy == "channel",
            activation_dynamic=weight_only or bool(acts.get("dynamic")),
            weight_only=weight_only,
            ignore=ignore,
        )
    if kind == "int":
        if qc.get("format") != "pack-quantized":
            raise ConfigError(
                f"compressed-tensors: int weights in format {qc.get('format')!r} are not read "
                f"(pack-quantized is)"
            )
        if acts is not None:
            raise ConfigError(
                "compressed-tensors: int weights with quantized activations (W8A8 int) are "
                "not supported; weight-only W4A16 and W8A16 are"
            )
        if strategy not in ("group", "channel"):
            raise ConfigError(f"compressed-tensors: int strategy {strategy!r} is not read")
        if not weights.get("symmetric", True):
            raise ConfigError("compressed-tensors: asymmetric pack-quantized weights are not read")
        # "weight" ("static") orders the quantization only; "group" ("dynamic") also orders
        # the groups, through each layer's weight_g_idx.
        actorder = weights.get("actorder")
        if actorder not in (None, "weight", "static", "group", "dynamic"):
            raise ConfigError(f"compressed-tensors: actorder {actorder!r} is not read")
        group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        _check_int("compressed-tensors", bits, group_size)
        desc_act = actorder in ("group", "dynamic")
        return QuantScheme(
            "int", "compressed-tensors", bits, group_size, desc_act=desc_act, ignore=ignore
        )
    raise ConfigError(
        f"compressed-tensors: {kind} {bits}-bit weights are not supported (fp8, and int 4/8-bit "
        f"pack-quantized are)"
    )


def _modelopt(qc: dict[str, Any]) -> QuantScheme:
    nested = qc.get("quantization")  # newer exports nest the fields
    inner: dict[str, Any] = nested if isinstance(nested, dict) else qc
    algo = str(inner.get("quant_algo"))
    if algo.upper() != "FP8":
        raise ConfigError(f"modelopt: quant_algo {algo!r} is not supported (FP8 is)")
    return QuantScheme(
        "fp8",
        "modelopt",
        weight_per_channel=False,
        activation_dynamic=False,
        ignore=tuple(inner.get("exclude_modules") or ()),
    )


def _fbgemm_fp8(qc: dict[str, Any]) -> QuantScheme:
    return QuantScheme("fp8", "fbgemm_fp8", ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _fp8(qc: dict[str, Any]) -> QuantScheme:
    if qc.get("weight_block_size"):
        raise ConfigError(
            f"fp8: block-wise fp8 (weight_block_size {qc['weight_block_size']}) is not supported "
            f"(per-tensor and per-channel weight scales are)"
        )
    scheme = str(qc.get("activation_scheme", "dynamic"))
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"fp8: activation_scheme {scheme!r} is not supported")
    return QuantScheme(
        "fp8",
        "fp8",
        weight_per_channel=False,
        activation_dynamic=scheme == "dynamic",
        ignore=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()),
    )


_PARSERS: dict[str, Callable[[dict[str, Any]], QuantScheme]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "modelopt": _modelopt,
    "fbgemm_fp8": _fbgemm_fp8,
    "fp8": _fp8,
}


def checkpoint_scheme(hf_config: dict[str, Any]) -> QuantScheme | None:
    """The scheme config.json's quantization_config describes, None for a dense checkpoint (or
    one whose quantized tensors are dequantized at load: MXFP4); refuses what is not read."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") in CHECKPOINT_QUANTIZATIONS:
        return None
    method = str(qc.get("quant_method"))
    parser = _PARSERS.get(method)
    if parser is None:
        raise ConfigError(
            f"quantization_config quant_method {method!r} is not supported (read: "
            f"{', '.join(SCHEME_METHODS)}; mxfp4 for GptOssForCausalLM)"
        )
    return parser(qc)


def quant_scheme(
    hf_config: dict[str, Any], requested: str | None, load_format: str = "auto"
) -> QuantScheme | None:
    """The scheme the linear weights run for --quantization `requested` (None: what the
    checkpoint says): the checkpoint's, or with dense weights fp8 quantized at load; with
    load_format 'dummy' the random weights are quantized at load (round to nearest; 4-bit
    groups of 128 for gptq and awq). None: dense (or GGUF, resolved elsewhere)."""
    if requested == "gguf":
        return None
    scheme = checkpoint_scheme(hf_config)
    if requested is not None and scheme is not None and scheme.source != requested:
        raise ConfigError(
            f"--quantization {requested} does not match the checkpoint, which is quantized "
            f"with {scheme.source} (its config.json's quantization_config); drop --quantization "
            f"or pass --quantization {scheme.source}"
        )
    if scheme is None and requested is not None:
        if load_format == "dummy":
            if requested in ("gptq", "awq"):
                return QuantScheme("int", requested, 4, 128, sym=False, quantize_at_load=True)
            return QuantScheme("fp8", requested, quantize_at_load=True, ignore=("lm_head",))
        if requested != "fp8":
            raise ConfigError(
                f"--quantization {requested} reads a checkpoint quantized with {requested}, "
                f"and this one has no quantization_config (dense weights); --quantization fp8 "
                f"quantizes dense weights at load"
            )
        return QuantScheme("fp8", "fp8", quantize_at_load=True, ignore=("lm_head",))
    if scheme is not None and load_format == "dummy":
        return dataclasses.replace(scheme, quantize_at_load=True)
    return scheme


def resolve_quantization(
    model: ModelConfig,
    load: LoadConfig,
    tensor_parallel_size: int,
    device_type: str,
    cpu_kernels_available: Callable[[], bool],
    hf_config: dict[str, Any] | None = None,
) -> str | None:
    """The quantized method the linear weights run (ModelConfig.quantization): 'gguf' when they
    stay GGUF-quantized (--load-format gguf asks for the same), a checkpoint's quant_method
    (or 'fp8' quantized at load) when hf_config's scheme keeps them quantized, else None.
    Refuses what the quantized path cannot run. On the CPU int weights take float32
    activations (the C kernels) and fp8 ones are dequantized at load; on CUDA activations take
    the model's dtype."""
    from config.default_model import names_gguf

    if load.load_format == "gguf" and model.quantization not in (None, "gguf"):
        raise ConfigError(
            f"load_format 'gguf' keeps a GGUF file's own quantization, not quantization "
            f"{model.quantization!r}"
        )
    requested = "gguf" if load.load_format == "gguf" else model.quantization
    is_gguf = names_gguf(model.model)
    if requested == "gguf" or (requested is None and is_gguf):
        return _resolve_gguf(
            model, load, tensor_parallel_size, device_type, cpu_kernels_available, requested
        )
    if requested is not None and is_gguf:
        raise ConfigError(
            f"quantization {requested!r} reads a safetensors checkpoint, not the GGUF model "
            f"{model.model!r} (its weights are GGUF-quantized: --quantization gguf)"
        )
    scheme = quant_scheme(hf_config or {}, requested, load.load_format)
    if scheme is None:
        return None
    experts = [k for k in _EXPERT_KEYS if int((hf_config or {}).get(k) or 0) > 0]
    if experts and not scheme.quantize_at_load:
        raise ConfigError(
            f"{scheme.source} checkpoints of mixture-of-experts models are not read yet: the "
            f"loader keeps Linear layers quantized, not experts ({experts[0]} in config.json)"
        )
    _check_scheme_runs(scheme, model, tensor_parallel_size, device_type, cpu_kernels_available)
    return scheme.source


def _check_scheme_runs(
    scheme: QuantScheme,
    model: ModelConfig,
    tp: int,
    device_type: str,
    cpu_kernels_available: Callable[[], bool],
) -> None:
    what = f"{scheme.source} {'fp8' if scheme.method == 'fp8' else f'{scheme.bits}-bit'} weights"
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{what} run on the CPU and on CUDA; there is no {device_type} path for them"
        )
    kept = scheme.method == "int" or device_type == "cuda"  # fp8 on the CPU: dequantized
    if kept and tp > 1:
        raise ConfigError(
            f"{what} are kept quantized and not split across tensor-parallel ranks yet: "
            f"tensor_parallel_size {tp} needs 1"
        )
    if scheme.method == "int" and device_type == "cpu":
        if model.dtype not in ("auto", "float32", "float"):
            raise ConfigError(
                f"{what} run on the CPU through the C kernels with float32 activations, not "
                f"{model.dtype}: drop --dtype or pass --dtype float32"
            )
        if not cpu_kernels_available():
            raise ConfigError(
                f"{what} need the C CPU kernels, which are not available here (no C "
                f"compiler, or ENGINE_CPU_KERNELS=0)"
            )


def _resolve_gguf(
    model: ModelConfig,
    load: LoadConfig,
    tp: int,
    device_type: str,
    cpu_kernels_available: Callable[[], bool],
    requested: str | None,
) -> str | None:
    from config.default_model import names_gguf

    is_gguf = names_gguf(model.model)
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
    gpt-oss's MXFP4 experts, which are dequantized at load, and the schemes of SCHEME_METHODS
    (checked in detail by checkpoint_scheme)."""
    qc = arch.hf_config.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in SCHEME_METHODS:
        try:
            checkpoint_scheme(arch.hf_config)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        return
    readers = CHECKPOINT_QUANTIZATIONS.get(str(method))
    known = "; ".join(f"{m} for {', '.join(a)}" for m, a in CHECKPOINT_QUANTIZATIONS.items())
    if readers is None:
        raise ConfigError(
            f"{source}: quantization_config quant_method {method!r} is not supported "
            f"(quantized checkpoints read: {', '.join(SCHEME_METHODS)}; {known})"
        )
    if arch.architecture not in readers:
        raise ConfigError(
            f"{source}: quantization_config quant_method {method!r} is read only for "
            f"{', '.join(readers)}, not {arch.architecture}"
        )
