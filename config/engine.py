"""EngineConfig: the groups of the engine's configuration in one object, resolved against the
model directory once, and its JSON form for the processes that receive it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from config.attention import AttentionFeatures, attention_backends_for
from config.cache import CacheConfig
from config.checkpoint import check_checkpoint
from config.device import DeviceConfig
from config.errors import ConfigError
from config.family_arch import FAMILY_PARSERS, check_family_config
from config.generation_config import check_generation_config, default_sampling_params
from config.load import LoadConfig
from config.model import ModelConfig
from config.model_arch import ModelArchConfig
from config.observability import ObservabilityConfig
from config.parallel import ParallelConfig
from config.quantization import check_checkpoint_quantization, resolve_quantization
from config.scheduler import SchedulerConfig, default_async_scheduling, default_batched_tokens
from config.speculative import SpeculativeConfig, parse_speculative_config
from config.vllm_only_args import ENGINE_ONLY, refusals


@dataclass(slots=True)
class EngineConfig:
    """The whole configuration; resolve() fills what depends on the model directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # --speculative-config (None: no speculative decoding).
    speculative: SpeculativeConfig | None = None
    # Filled by resolve():
    model_path: str = ""
    # The tokenizer's folder: model_path, --tokenizer's, or a Hub tokenizer's snapshot.
    tokenizer_path: str = ""
    arch: ModelArchConfig | None = None
    device_type: str = ""
    torch_dtype_name: str = ""
    # The generation config's request defaults (config/generation_config.py), read once here so
    # that no other process reads the model directory for them.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def resolve(self, cpu_kernels_available: Callable[[], bool]) -> EngineConfig:
        """Locate the model, read its config, and check the settings against it.
        cpu_kernels_available: whether the C CPU kernels load here (kernels/cpu_library.py's
        available(); engine_core/resolve.py passes it), asked only for a GGUF model on the CPU."""
        self._locate_model()
        self.arch = ModelArchConfig.from_model_dir(self.model_path)
        self.device_type = self.device.resolved()
        check_checkpoint_quantization(self.arch, f"{self.model_path}/config.json")
        self.model.quantization = resolve_quantization(
            self.model,
            self.load,
            self.parallel.tensor_parallel_size,
            self.device_type,
            cpu_kernels_available,
            self.arch.hf_config,
        )
        if self.model.quantization == "gguf":
            self.load.load_format = "gguf"  # the loader reads the GGUF file itself
        check_checkpoint(self.model_path, self.arch, self.load.load_format, self.model_name)
        check_family_config(self.arch, self.parallel, self.model_name)
        self.torch_dtype_name = _resolve_dtype(
            self.model.dtype, self.arch.torch_dtype, self.device_type
        )
        # Linear, dynamic NTK and YaRN scaling extend the context (config/rope_arch.py); the
        # default stays max_position_embeddings, as the model's rotary tables are sized for both.
        limit = self.arch.max_context_len
        if self.model.max_model_len is None:
            self.model.max_model_len = self.arch.max_position_embeddings
        elif self.model.max_model_len > limit:
            positions = self.arch.max_position_embeddings
            scaling = self.arch.rope_scaling or {}
            extended = (
                f" extended by its {scaling.get('rope_type')} rope scaling to {limit}"
                if limit > positions
                else ""
            )
            raise ConfigError(
                f"max_model_len {self.model.max_model_len} exceeds the model's "
                f"max_position_embeddings {positions}{extended}"
            )
        # A kernel that cannot run these would fail at the first forward, after the model loaded.
        attention_backends_for(
            self.device_type,
            self.cache.block_size,
            self.arch.head_dim,
            self.torch_dtype_name,
            AttentionFeatures.of(self.arch, self.model.max_model_len, self.cache.kv_cache_dtype),
        )
        if self.scheduler.max_num_batched_tokens is None:
            self.scheduler.max_num_batched_tokens = default_batched_tokens(self.device_type)
        if self.speculative is not None:
            self._resolve_speculative(self.speculative, cpu_kernels_available)
        if self.scheduler.async_scheduling is None:
            self.scheduler.async_scheduling = default_async_scheduling(self.device_type)
        if self.model.served_model_name is None:
            self.model.served_model_name = self.model.model or "SmolLM2-135M-Instruct"
            self.model.served_model_names = [self.model.served_model_name]
        self._check_generation_config()
        if self.model.cuda_graph_sizes is not None and self.device_type != "cuda":
            raise ConfigError(
                f"cuda_graph_sizes asks for CUDA graphs, which exist only on CUDA; the "
                f"{self.device_type} device runs every step eagerly"
            )
        if self.model.cuda_graph_sizes is not None and self.parallel.tensor_parallel_size > 1:
            raise ConfigError(
                "cuda_graph_sizes: CUDA graphs are not captured with tensor parallelism "
                "(its all-reduce runs eagerly); drop the flag or run one device per model"
            )
        heads, kv_heads = self.arch.num_attention_heads, self.arch.num_key_value_heads
        tp = self.parallel.tensor_parallel_size
        if heads % tp or kv_heads % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} must divide the number of attention heads ({heads}) "
                f"and of KV heads ({kv_heads})"
            )
        # A dense family's every gated MLP splits intermediate_size over the ranks (a mixture of
        # experts' split is check_family_config's).
        if self.arch.architecture not in FAMILY_PARSERS and self.arch.intermediate_size % tp:
            raise ConfigError(
                f"model {self.model_name} ({self.arch.architecture}): config.json's "
                f"intermediate_size ({self.arch.intermediate_size}) is not divisible by "
                f"tensor_parallel_size {tp}"
            )
        return self

    def _resolve_speculative(
        self, spec: SpeculativeConfig, cpu_kernels_available: Callable[[], bool]
    ) -> None:
        """Check --speculative-config against the rest: speculative steps are scheduled
        synchronously (async scheduling is off unless asked for, and then refused), the draft
        runs at the target's tensor-parallel size, and the draft model or head (located with the
        target, _locate_model) is checked against the target."""
        if self.scheduler.async_scheduling:
            raise ConfigError(
                "--async-scheduling with --speculative-config: speculative steps are "
                "scheduled one at a time (the accepted tokens decide the next step); drop "
                "--async-scheduling"
            )
        self.scheduler.async_scheduling = False
        tp = self.parallel.tensor_parallel_size
        if spec.draft_tensor_parallel_size not in (None, tp):
            raise ConfigError(
                f"speculative_config: draft_tensor_parallel_size "
                f"{spec.draft_tensor_parallel_size} differs from tensor_parallel_size {tp}; "
                "the draft runs sharded like the target"
            )
        from config.draft_model import check_draft_model
        from config.eagle_head import check_eagle_head

        check_draft_model(self, cpu_kernels_available)
        if spec.method in ("eagle", "eagle3"):
            check_eagle_head(self)

    def _locate_model(self) -> None:
        """model_path and tokenizer_path: local folders, Hub ids' snapshots (config/hub.py) or
        converted GGUF files. The token goes after use: the resolved configuration is passed
        to the processes it starts on their command lines."""
        from config.default_model import resolve_model_path, resolve_tokenizer_path
        from config.hub import HubOptions

        model = self.model
        hub = HubOptions(model.revision, self.load.download_dir, model.hf_token)
        tokenizer_hub = replace(hub, revision=model.tokenizer_revision or model.revision)
        own_tokenizer = model.tokenizer is None and tokenizer_hub.revision == hub.revision
        weights = self.load.load_format != "dummy"
        path = resolve_model_path(model.model, hub, weights=weights, tokenizer=own_tokenizer)
        self.model_path = str(path)
        self.tokenizer_path = self.model_path
        if not own_tokenizer:
            tokenizer = resolve_tokenizer_path(model.tokenizer, model.model, path, tokenizer_hub)
            self.tokenizer_path = str(tokenizer)
        spec = self.speculative
        if spec is not None and spec.model is not None and not spec.model_path:
            # A draft model or EAGLE head, found (or downloaded) as the target is, token and all.
            draft_hub = replace(hub, revision=spec.revision)
            spec.model_path = str(
                resolve_model_path(spec.model, draft_hub, weights=weights, tokenizer=False)
            )
        model.hf_token = None

    @property
    def model_name(self) -> str:
        """The model as messages name it: a Hub id as given, else the folder's name."""
        from config.hub import parse_hub_id

        given = self.model.model
        if given is not None and parse_hub_id(given) is not None:
            return given
        return Path(self.model_path).name or self.model_path

    def cuda_graph_capture_sizes(self) -> list[int]:
        """The decode batch sizes to capture as CUDA graphs, ascending; none on the CPU, with
        enforce_eager, or with tensor parallelism."""
        if (
            self.device_type != "cuda"
            or self.model.enforce_eager
            or self.parallel.tensor_parallel_size > 1
        ):
            return []
        return capture_sizes(self.model.cuda_graph_sizes, self.scheduler.max_num_seqs)

    def _check_generation_config(self) -> None:
        """Refuse a --generation-config folder without the file, and an override that is not
        a sampling default vLLM takes from it; keep the defaults it sets."""
        check_generation_config(self.model, self.model_path)
        self.sampling_defaults = default_sampling_params(self.model, self.model_path)

    def encode(self) -> str:
        """This configuration as JSON, for a process that should not resolve it again
        (decode_config reads it back)."""
        return msgspec.json.encode(self).decode()

    def for_rank(self, rank: int) -> EngineConfig:
        """A copy for data-parallel rank rank."""
        copy = decode_config(self.encode())
        copy.parallel.data_parallel_rank = rank
        return copy

    @property
    def max_model_len(self) -> int:
        """The resolved context length (prompt + output)."""
        assert self.model.max_model_len is not None, "EngineConfig.resolve() not called"
        return self.model.max_model_len


def decode_config(text: str | bytes) -> EngineConfig:
    """The EngineConfig that EngineConfig.encode() wrote; ConfigError when it is not one."""
    try:
        return msgspec.json.decode(text, type=EngineConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ConfigError(f"not an encoded engine configuration: {e}") from None


def _resolve_dtype(requested: str, checkpoint: str, device: str) -> str:
    aliases = {"float": "float32", "half": "float16"}
    if requested != "auto":
        return aliases.get(requested, requested)
    if device == "cpu":
        return "float32"  # bf16 matmul is slow on CPUs without AVX-512 BF16
    return "bfloat16" if checkpoint in ("float32", "bfloat16") else checkpoint


# vLLM's names for fields this engine calls otherwise.
KWARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}


def capture_sizes(requested: list[int] | None, max_num_seqs: int) -> list[int]:
    """vLLM's reading of --cuda-graph-sizes: one value N means 1, 2, 4, then multiples of 8 up
    to N; several values mean those. None means N = max_num_seqs. Sizes above max_num_seqs are
    dropped (no step has more decodes), and max_num_seqs itself is added when one was dropped
    so the largest batch still has a graph."""
    if requested is None or len(requested) == 1:
        top = min(requested[0] if requested else max_num_seqs, max_num_seqs)
        sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    else:
        sizes = {min(s, max_num_seqs) for s in requested}
    return sorted(sizes)


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat vLLM-style keyword arguments; unknown names are refused."""
    groups: dict[str, Any] = {  # dataclass types
        "model": ModelConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "parallel": ParallelConfig,
        "load": LoadConfig,
        "device": DeviceConfig,
        "observability": ObservabilityConfig,
    }
    per_group: dict[str, dict[str, Any]] = {g: {} for g in groups}
    owner = {
        name: g
        for g, cls in groups.items()
        for name, f in cls.__dataclass_fields__.items()
        if f.init
    }
    for alias, name in KWARG_ALIASES.items():
        if alias in kwargs:
            if name in kwargs:
                raise ConfigError(f"give one of {alias} and {name}, not both")
            kwargs[name] = kwargs.pop(alias)
    speculative = parse_speculative_config(kwargs.pop("speculative_config", None))
    refused = refusals(
        {k: v for k, v in kwargs.items() if k in ENGINE_ONLY}, ENGINE_ONLY, as_flags=False
    )
    if refused:
        raise ConfigError("; ".join(refused))
    kwargs = {k: v for k, v in kwargs.items() if k not in ENGINE_ONLY}  # the no-ops
    unknown = [k for k in kwargs if k not in owner]
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    for key, value in kwargs.items():
        per_group[owner[key]][key] = value
    return EngineConfig(
        **{g: cls(**per_group[g]) for g, cls in groups.items()}, speculative=speculative
    )
