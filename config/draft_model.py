"""The draft model of --speculative-config's draft_model method, checked against the target once,
when the configuration resolves: everything the worker would otherwise discover only after
loading both models is refused here in one line.

The draft runs beside the target in every worker (gpu_worker/spec_decode/draft_model.py): in the
target's dtype, tensor-parallel sharding, KV-cache dtype and block size, its KV in the same block
ids, proposing token ids the target verifies. So it must read the target's token ids (the same
vocabulary), reach the target's max_model_len, and be a model the engine itself runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from config.attention import AttentionFeatures, attention_backends_for
from config.checkpoint import check_checkpoint
from config.errors import ConfigError
from config.family_arch import FAMILY_PARSERS, check_family_config
from config.kv_window import model_wide_window
from config.load import LoadConfig
from config.model_arch import ModelArchConfig
from config.quantization import check_checkpoint_quantization, resolve_quantization

if TYPE_CHECKING:
    from config.engine import EngineConfig


def draft_arch(config: EngineConfig) -> ModelArchConfig:
    """The draft's config.json, read from SpeculativeConfig.model_path (resolved)."""
    spec = config.speculative
    assert spec is not None and spec.model_path, "EngineConfig.resolve() not called"
    try:
        return ModelArchConfig.from_model_dir(spec.model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"speculative_config: draft model {spec.model}: {e}") from None


def draft_load(
    config: EngineConfig, cpu_kernels_available: Callable[[], bool]
) -> tuple[str, str | None]:
    """(load_format, quantization) the draft loads with, resolved as the target's would be
    with the target's --dtype: random weights when the target's are (load_format dummy), else
    the checkpoint as it is (a GGUF file's quantization kept where the target's would be, a
    GPTQ/AWQ/FP8 checkpoint's scheme, dense weights otherwise)."""
    spec = config.speculative
    assert spec is not None and config.arch is not None
    arch = draft_arch(config)
    load = LoadConfig(load_format="dummy" if config.load.load_format == "dummy" else "auto")
    model = dataclasses.replace(config.model, model=spec.model, quantization=None)
    try:
        quantization = resolve_quantization(
            model,
            load,
            config.parallel.tensor_parallel_size,
            config.device_type,
            cpu_kernels_available,
            arch.hf_config,
        )
    except ConfigError as e:
        raise ConfigError(f"speculative_config: draft model {spec.model}: {e}") from None
    return ("gguf" if quantization == "gguf" else load.load_format), quantization


def check_draft_model(config: EngineConfig, cpu_kernels_available: Callable[[], bool]) -> None:
    """Raise ConfigError (one line) when the engine cannot run config.speculative's draft model
    beside the target: an architecture or checkpoint it does not load, another vocabulary, heads
    that tensor_parallel_size does not divide, a context shorter than max_model_len, LongRoPE,
    an attention the backends cannot run, or full attention over blocks the target's sliding
    window frees. Methods other than draft_model have nothing to check here."""
    spec, target = config.speculative, config.arch
    if spec is None or spec.method != "draft_model":
        return
    assert target is not None
    name = spec.model or spec.model_path
    where = f"speculative_config: draft model {name}"
    arch = draft_arch(config)
    check_checkpoint_quantization(arch, f"{spec.model_path}/config.json")
    load_format, _ = draft_load(config, cpu_kernels_available)
    check_checkpoint(spec.model_path, arch, load_format, name)
    check_family_config(arch, config.parallel, name)
    if arch.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model must share the target's tokenizer/vocabulary: "
            f"{arch.vocab_size} vs {target.vocab_size} (vocab_size of the draft {name} vs "
            f"the target's)"
        )
    tp = config.parallel.tensor_parallel_size
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp or kv_heads % tp:
        raise ConfigError(
            f"{where}: tensor_parallel_size {tp} must divide its attention heads ({heads}) and "
            f"KV heads ({kv_heads}); the draft runs sharded like the target"
        )
    if arch.architecture not in FAMILY_PARSERS and arch.intermediate_size % tp:
        raise ConfigError(
            f"{where}: its intermediate_size ({arch.intermediate_size}) is not divisible by "
            f"tensor_parallel_size {tp}"
        )
    if config.max_model_len > arch.max_context_len:
        raise ConfigError(
            f"{where}: max_model_len {config.max_model_len} exceeds the draft's context of "
            f"{arch.max_context_len} tokens; the draft reads every position the target does "
            f"(lower max_model_len)"
        )
    if (arch.rope_scaling or {}).get("rope_type") == "longrope":
        raise ConfigError(
            f"{where}: a LongRoPE draft is not supported (its long factors follow the "
            f"target's per-request choice)"
        )
    try:
        attention_backends_for(
            config.device_type,
            config.cache.block_size,
            arch.head_dim,
            config.torch_dtype_name,
            AttentionFeatures.of(arch, config.max_model_len, config.cache.kv_cache_dtype),
        )
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    # The engine core frees a request's blocks behind the target's model-wide window: the draft
    # shares them, so none of its layers may attend further back.
    window = model_wide_window(target, config.max_model_len)
    if window is not None:
        for i in range(arch.num_hidden_layers):
            layer = arch.layer_sliding_window(i)
            if layer is None or layer > window:
                sees = "the whole context" if layer is None else f"{layer} tokens"
                raise ConfigError(
                    f"{where}: its layer {i} attends to {sees}, beyond the target's sliding "
                    f"window of {window}, behind which the engine frees the KV blocks both share"
                )
