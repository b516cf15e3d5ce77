"""EngineConfig: the engine's configuration, validated at construction."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from config.errors import ConfigError
from config.generation_config import check_generation_config, default_sampling_params
from config.model_arch import ModelArchConfig
from config.vllm_only_args import ENGINE_ONLY, refusals

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
QUANTIZATIONS = ("gguf",)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
# Without one of these (NVIDIA's driver, ROCm's, WSL's) torch.cuda.is_available() is False.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
HASH_ALGOS = ("sha256", "xxhash", "builtin")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB' or '1e9'."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    try:
        number = float(m.group(1)) if m else None  # '1.2.3' or 'e' pass the pattern, not float()
    except ValueError:
        number = None
    unit = m.group(2).lower() if m else ""
    if number is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {value!r}; use bytes or a unit such as '2GiB' or '512MB'"
        )
    return int(number * _SIZE_UNITS[unit])


@dataclass(frozen=True, slots=True)
class AttentionSupport:
    """The block sizes, head sizes and dtypes one attention backend runs; None: any value."""

    backend: str
    block_sizes: tuple[int, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] | None = None

    def refusal(
        self, block_size: int, head_dim: int, dtype: str
    ) -> tuple[str, int | str, tuple[int | str, ...]] | None:
        """(field, value, supported values) of the first setting this backend cannot run, or
        None when it runs them all."""
        for name, value, allowed in (
            ("block_size", block_size, self.block_sizes),
            ("head_dim", head_dim, self.head_dims),
            ("dtype", dtype, self.dtypes),
        ):
            if allowed is not None and value not in allowed:
                return name, value, allowed
        return None


# Each device type's attention backends, most preferred first: gpu_worker/attention/select.py
# takes the first that runs a configuration (and whose code is usable there), and
# EngineConfig.resolve() refuses a configuration none of them runs. Derived from the kernels:
ATTENTION_BACKENDS: dict[str, tuple[AttentionSupport, ...]] = {
    "cuda": (
        # kernels/paged_attention.py and write_kv.py (Triton).
        AttentionSupport(
            "triton",
            # Powers of two <= 128: at 256, BLOCK_N = 256 makes head_dim-128 K+V tiles 128 KiB a
            # pipeline stage in bf16 (an H100 has 227 KiB) and the fp32 scores 128 regs a thread.
            block_sizes=(1, 8, 16, 32, 64, 128),
            # tl.dot needs a power of two >= 16; at 512 the [64, head_dim] fp32 accumulator alone
            # is 256 registers a thread at 4 warps (the limit is 255).
            head_dims=(16, 32, 64, 128, 256),
            dtypes=("float16", "bfloat16", "float32"),
        ),
    ),
    "cpu": (
        # kernels/cpu/paged_attention.c: compiled for these head sizes, 16 positions a step.
        AttentionSupport(
            "cpu", block_sizes=(16, 32, 64, 128, 256), head_dims=(64, 128), dtypes=("float32",)
        ),
        # gpu_worker/attention/torch_backend.py: gathers K/V into plain torch ops; runs anything.
        AttentionSupport("torch"),
    ),
}


def attention_backends_for(
    device_type: str, block_size: int, head_dim: int, dtype: str
) -> list[str]:
    """The names of device_type's attention backends that run this block size, head size and
    dtype (a resolved name such as 'bfloat16'), most preferred first; raises ConfigError naming
    the supported values when none does. Needs no device of that type."""
    table = ATTENTION_BACKENDS.get(device_type)
    if table is None:
        raise ConfigError(
            f"no attention backend for device type {device_type!r}; "
            f"known: {', '.join(ATTENTION_BACKENDS)}"
        )
    names = [s.backend for s in table if s.refusal(block_size, head_dim, dtype) is None]
    if names:
        return names
    reasons = []
    for support in table:
        refusal = support.refusal(block_size, head_dim, dtype)
        assert refusal is not None  # none of them runs it (names is empty)
        name, value, allowed = refusal
        reasons.append(
            f"{name} {value} is not supported by the {support.backend} attention "
            f"kernels on {device_type}, which take {name} {_one_of(allowed)}"
        )
    raise ConfigError("; ".join(reasons))


def _one_of(values: tuple) -> str:
    """'1, 8 or 16'."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


@dataclass(slots=True)
class ModelConfig:
    """Which model, in which dtype, how long a sequence may get."""

    model: str | None = None
    tokenizer: str | None = None
    # One name or several (vLLM's list): the API answers to each; the first is the one reported
    # (responses, metrics). None: the --model value. served_model_names holds them all.
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    max_logprobs: int = 20
    # 'gguf': linear weights stay as the GGUF file quantizes them, run by the CPU kernels with
    # float32 activations. None: resolve() picks 'gguf' for a GGUF model (a .gguf file or the
    # default model) on the CPU when dtype is 'auto'; an explicit dtype dequantizes at load.
    quantization: str | None = None
    # vLLM's --enforce-eager: no CUDA graphs (on the CPU every step is eager anyway).
    enforce_eager: bool = False
    # vLLM's --cuda-graph-sizes: one value N captures decode batches of 1, 2, 4 and multiples
    # of 8 up to N; several values capture exactly those. None: N = max_num_seqs. Capped at
    # max_num_seqs either way (cuda_graph_capture_sizes()).
    cuda_graph_sizes: list[int] | None = None
    # vLLM's --trust-remote-code: accepted; the loader never runs a model's own code (it says
    # so once when a model's config.json asks for it through auto_map).
    trust_remote_code: bool = False
    # 'auto': the model's generation_config.json gives defaults to requests that leave a
    # sampling field unset (engine_core.generation_config); 'vllm': none; else a folder.
    generation_config: str = "auto"
    # Merged over those defaults, e.g. {"temperature": 0.5}: a dict or its JSON text.
    override_generation_config: dict[str, Any] | str | None = None
    served_model_names: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_served_names()
        if isinstance(self.override_generation_config, str):
            try:
                self.override_generation_config = json.loads(self.override_generation_config)
            except ValueError as e:
                raise ConfigError(f"override_generation_config is not valid JSON: {e}") from None
        if not isinstance(self.override_generation_config, (dict, type(None))):
            raise ConfigError(
                "override_generation_config must be a JSON object, e.g. '{\"temperature\": 0.5}'"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be -1 or non-negative, got {self.max_logprobs}")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ConfigError(
                f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}"
            )
        if self.cuda_graph_sizes is not None and self.enforce_eager:
            raise ConfigError(
                "cuda_graph_sizes asks for CUDA graphs, which enforce_eager turns off: pass one"
            )

    def _check_served_names(self) -> None:
        names = self.served_model_name
        if names is None:
            return
        if isinstance(names, str):
            names = [names]
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"served_model_name must be a non-empty name or list of names, "
                f"got {self.served_model_name!r}"
            )
        if self.served_model_names[:1] == names:  # decoded (EngineConfig.encode): both kept
            return
        self.served_model_names = list(dict.fromkeys(names))
        self.served_model_name = names[0]


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache shape and prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as e:
                raise ConfigError(f"kv_cache_memory: {e}") from None
            if self.kv_cache_memory <= 0:
                raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be at least 1")


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step limits of continuous batching."""

    max_num_seqs: int = 256
    # None: resolve() picks by device (see default_batched_tokens).
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    # Schedule step N+1 while step N runs (vLLM's --async-scheduling); see engine_core.engine_core.
    # None: resolve() picks by device (see default_async_scheduling).
    async_scheduling: bool | None = None
    # Tokens a streamed completion gathers before its next chunk goes out (vLLM's
    # --stream-interval): 1 streams every token; more costs the serving processes fewer
    # wake-ups per token. The first token and the last chunk go out at once.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )


def default_batched_tokens(device_type: str) -> int:
    """The per-step token budget when none is given: 8192 on a GPU; 2048 on the CPU, where a
    step's GEMMs are already large at 2048 rows and bigger steps only add fresh ~100 MB
    activations (offline-mixed measured 22.9 s at 8192 and 20.8 s at 2048) and longer waits for
    the decodes sharing the step."""
    return 2048 if device_type == "cpu" else 8192


def default_async_scheduling(device_type: str) -> bool:
    """On by default where the model runs on a device (as vLLM): the host schedules and prepares
    step N+1 while the device runs step N. Off on the CPU, where the forward runs on the same
    cores, so there is nothing to overlap: null-model measured 79/88 ms per step synchronous
    against 93/106 ms with the model on its own thread (2 cores)."""
    return device_type != "cpu"


@dataclass(slots=True)
class ParallelConfig:
    """How many devices share the model."""

    tensor_parallel_size: int = 1
    # 'uni': the worker runs in the engine core's process; 'mp': one worker process per rank;
    # 'ray': one Ray actor per rank, on the nodes of a Ray cluster. None picks 'mp' when
    # tensor_parallel_size > 1, else 'uni'.
    distributed_executor_backend: str | None = None
    # Data parallelism (engine serve only): data_parallel_size engine cores in all, of which
    # data_parallel_size_local (default: all) run on this host from data_parallel_start_rank;
    # other hosts' ranks join at data_parallel_address:data_parallel_rpc_port.
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # 'mp': engine serve starts the engine cores as its child processes (other hosts' with
    # --headless); 'ray': each engine core runs in a Ray actor placed on a Ray cluster's nodes.
    data_parallel_backend: str = "mp"
    # Set by engine serve for each engine core it starts; None outside a DP group.
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        backend = self.distributed_executor_backend
        if backend not in (None, *EXECUTOR_BACKENDS):
            raise ConfigError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "distributed_executor_backend 'ray' needs Ray, which is not "
                "installed: pip install ray (the engine's [ray] extra)"
            )
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ConfigError(
                f"data_parallel_backend must be one of "
                f"{', '.join(DATA_PARALLEL_BACKENDS)}, got "
                f"{self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray":
            if importlib.util.find_spec("ray") is None:
                raise ConfigError(
                    "data_parallel_backend 'ray' needs Ray, which is not "
                    "installed: pip install ray (the engine's [ray] extra)"
                )
            if backend == "ray":
                raise ConfigError(
                    "data_parallel_backend 'ray' runs each engine core's "
                    "tensor-parallel ranks on its actor's node (mp); "
                    "distributed_executor_backend 'ray' inside it is not supported"
                )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend 'uni' runs a single worker; tensor_parallel_size "
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )

    @property
    def executor_backend(self) -> str:
        """The resolved backend: 'uni', 'mp' or 'ray'."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"


@dataclass(slots=True)
class LoadConfig:
    """Where weights come from."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )


@dataclass(slots=True)
class DeviceConfig:
    """Which device runs the model: auto picks CUDA when present."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    def resolved(self) -> str:
        """'cuda' or 'cpu'."""
        if self.device != "auto":
            return self.device
        if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
            return "cpu"  # no GPU driver: torch would say the same after seconds of importing
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ObservabilityConfig:
    """What the processes log (vLLM's names)."""

    # No periodic throughput line from the engine core; /metrics keeps counting.
    disable_log_stats: bool = False
    # The API servers log each request they receive (id and body, cut at max_log_len).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # Every process's log level ('trace' logs as 'debug').
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"max_log_len must not be negative, got {self.max_log_len}")


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
    # Filled by resolve():
    model_path: str = ""
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
        from config.default_model import resolve_model_path

        self.model_path = str(resolve_model_path(self.model.model))
        self.arch = ModelArchConfig.from_model_dir(self.model_path)
        self.device_type = self.device.resolved()
        self.model.quantization = self._resolve_quantization(cpu_kernels_available)
        if self.model.quantization == "gguf":
            self.load.load_format = "gguf"  # the loader reads the GGUF file itself
        self.torch_dtype_name = _resolve_dtype(
            self.model.dtype, self.arch.torch_dtype, self.device_type
        )
        # A kernel that cannot run these would fail at the first forward, after the model loaded.
        attention_backends_for(
            self.device_type, self.cache.block_size, self.arch.head_dim, self.torch_dtype_name
        )
        limit = self.arch.max_position_embeddings
        if self.model.max_model_len is None:
            self.model.max_model_len = limit
        elif self.model.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.model.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if self.scheduler.max_num_batched_tokens is None:
            self.scheduler.max_num_batched_tokens = default_batched_tokens(self.device_type)
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
        return self

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

    def _resolve_quantization(self, cpu_kernels_available: Callable[[], bool]) -> str | None:
        """'gguf' when the linear weights stay GGUF-quantized, else None (ModelConfig.quantization);
        --load-format gguf asks for the same. Refuses what the quantized path cannot run. On
        the CPU activations are float32 (the C kernels); on CUDA they take the model's dtype
        (the Triton kernels dequantize into it)."""
        from config.default_model import gguf_source

        requested = "gguf" if self.load.load_format == "gguf" else self.model.quantization
        is_gguf = gguf_source(self.model.model) is not None
        tp = self.parallel.tensor_parallel_size
        if requested is None:
            auto = (
                is_gguf
                and self.device_type == "cpu"
                and self.model.dtype == "auto"
                and tp == 1
                and self.load.load_format == "auto"
                and cpu_kernels_available()
            )
            return "gguf" if auto else None
        if not is_gguf:
            raise ConfigError(
                f"quantization 'gguf' needs a GGUF model (a .gguf file or the "
                f"default model), not {self.model.model!r}"
            )
        if self.device_type not in ("cpu", "cuda"):
            raise ConfigError(
                f"GGUF quantized weights run on the CPU and on CUDA (there is no "
                f"{self.device_type} kernel for them): drop --quantization gguf and pass "
                f"--dtype bfloat16 or --dtype float32 to dequantize them at load"
            )
        if self.device_type == "cpu" and self.model.dtype not in ("auto", "float32", "float"):
            raise ConfigError(
                f"quantization 'gguf' computes in float32 on the CPU, not "
                f"{self.model.dtype}; drop --quantization to run dequantized weights in "
                f"{self.model.dtype}"
            )
        if tp > 1:
            raise ConfigError(
                f"GGUF quantized weights are not split across tensor-parallel ranks: "
                f"tensor_parallel_size {tp} needs dequantized weights (--dtype "
                f"float32, without --quantization gguf)"
            )
        if self.load.load_format not in ("auto", "gguf"):
            raise ConfigError(
                f"quantization 'gguf' loads the GGUF file, not load_format "
                f"{self.load.load_format!r}"
            )
        if self.device_type == "cpu" and not cpu_kernels_available():
            raise ConfigError(
                "GGUF quantized weights need the C CPU kernels, which are not "
                "available here (no C compiler, or ENGINE_CPU_KERNELS=0)"
            )
        return "gguf"

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
    return EngineConfig(**{g: cls(**per_group[g]) for g, cls in groups.items()})
