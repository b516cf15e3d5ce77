"""Command-line flags for the engine's configuration, with vLLM's names."""

from __future__ import annotations

import argparse
from typing import Any

from config.cache import BLOCK_SIZES, HASH_ALGOS
from config.device import DEVICES
from config.load import LOAD_FORMATS
from config.model import DTYPES, QUANTIZATIONS
from config.observability import LOG_LEVELS
from config.parallel import DATA_PARALLEL_BACKENDS, EXECUTOR_BACKENDS
from config.vllm_only_args import ENGINE_ONLY, add_vllm_only_args, refuse_vllm_only


def context_length(value: str) -> int:
    """'4096', '32k' or '1m' -> tokens."""
    v = value.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(v[-1:], 1)
    try:
        return int(float(v[:-1] if scale > 1 else v) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid context length {value!r}") from None


def max_model_len(value: str) -> int | None:
    """--max-model-len as vLLM reads it: '4096'; '32k' (32000) or '32K' (32768), m/M and g/G
    alike; '-1' or 'auto': None, the model's own limit."""
    v = value.strip()
    if v.lower() in ("-1", "auto"):
        return None
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(v[-1:], 1)
    try:
        return int(float(v[:-1] if scale > 1 else v) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid context length {value!r}") from None


# (flag, EngineConfig field, argparse keyword arguments); defaults live in the dataclasses.
_GROUPS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "model": [
        (
            "--model",
            "model",
            dict(
                help="model directory, .gguf file, Hugging Face Hub id (org/name) or a Hub GGUF "
                "repository's file (org/name:Q4_K_M) (default: SmolLM2-135M-Instruct)"
            ),
        ),
        (
            "--tokenizer",
            "tokenizer",
            dict(help="tokenizer directory or Hub id (default: the model's)"),
        ),
        (
            "--revision",
            "revision",
            dict(help="a Hub model's branch, tag or commit (default: main)"),
        ),
        (
            "--tokenizer-revision",
            "tokenizer_revision",
            dict(help="a Hub tokenizer's branch, tag or commit (default: --revision)"),
        ),
        (
            "--hf-token",
            "hf_token",
            dict(
                nargs="?",
                const=True,
                metavar="TOKEN",
                help="Hugging Face token for private or gated Hub models (default, or without "
                "a value: $HF_TOKEN, else the one `hf auth login` saved)",
            ),
        ),
        (
            "--served-model-name",
            "served_model_name",
            dict(
                nargs="+",
                metavar="NAME",
                help="names the API answers to; the first is the one "
                "reported (default: the --model value)",
            ),
        ),
        (
            "--dtype",
            "dtype",
            dict(
                choices=DTYPES,
                help="auto: float32 on CPU, bfloat16 on GPU; an "
                "explicit dtype without --quantization "
                "dequantizes a GGUF model at load",
            ),
        ),
        (
            "--quantization",
            "quantization",
            dict(
                choices=QUANTIZATIONS,
                help="gguf: keep a GGUF model's linear weights quantized (CPU, "
                "float32 activations; the default for GGUF models on "
                "CPU with --dtype auto); gptq, awq, compressed-tensors, modelopt, "
                "fbgemm_fp8: the checkpoint's format (default: its config.json's "
                "quantization_config); fp8 on a dense checkpoint: quantized at load",
            ),
        ),
        (
            "--max-model-len",
            "max_model_len",
            dict(
                type=max_model_len,
                help="context length, prompt + output, as vLLM reads it: 4096, "
                "32k (32000), 32K (32768); -1 or auto: the model's",
            ),
        ),
        ("--seed", "seed", dict(type=int, help="random seed (default 0)")),
        (
            "--max-logprobs",
            "max_logprobs",
            dict(type=int, help="largest logprobs a request may ask (default 20)"),
        ),
        (
            "--enforce-eager",
            "enforce_eager",
            dict(
                action="store_true",
                help="no CUDA graphs: every step runs eagerly (always so on the CPU)",
            ),
        ),
        (
            "--cuda-graph-sizes",
            "cuda_graph_sizes",
            dict(
                type=int,
                nargs="+",
                metavar="N",
                help="decode batch sizes captured as CUDA graphs: one value N means 1, 2, 4 "
                "and multiples of 8 up to N; several values, exactly those (default: N = "
                "--max-num-seqs; CUDA only)",
            ),
        ),
        (
            "--trust-remote-code",
            "trust_remote_code",
            dict(
                action="store_true",
                help="accepted: a model's own code is never run (the "
                "engine says so when a model asks for it)",
            ),
        ),
        (
            "--generation-config",
            "generation_config",
            dict(
                metavar="auto|vllm|FOLDER",
                help="auto: the model's generation_config.json sets defaults (temperature, "
                "top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens) "
                "for requests that leave them unset; vllm: none; or a folder holding a "
                "generation_config.json (default auto)",
            ),
        ),
        (
            "--override-generation-config",
            "override_generation_config",
            dict(metavar="JSON", help="merged over those defaults, e.g. '{\"temperature\": 0.5}'"),
        ),
    ],
    "cache": [
        (
            "--block-size",
            "block_size",
            dict(
                type=int,
                choices=BLOCK_SIZES,
                help="tokens per KV block (default 16; up to 128 on CUDA)",
            ),
        ),
        (
            "--enable-prefix-caching",
            "enable_prefix_caching",
            dict(
                action=argparse.BooleanOptionalAction,
                help="reuse KV of shared prompt prefixes (default on)",
            ),
        ),
        ("--prefix-caching-hash-algo", "prefix_caching_hash_algo", dict(choices=HASH_ALGOS)),
        (
            "--gpu-memory-utilization",
            "gpu_memory_utilization",
            dict(
                type=float,
                help="fraction of GPU memory for weights, activations and KV cache (default 0.9)",
            ),
        ),
        (
            "--kv-cache-memory-bytes",
            "kv_cache_memory",
            dict(
                help="KV cache size in bytes, or with a unit: 2GiB, 512MB (default on CPU: "
                "2GiB; on GPU: from --gpu-memory-utilization); alias --kv-cache-memory"
            ),
        ),
        (
            "--num-gpu-blocks-override",
            "num_gpu_blocks_override",
            dict(type=int, help="exact number of KV blocks"),
        ),
        (
            "--kv-cache-dtype",
            "kv_cache_dtype",
            dict(
                metavar="auto|fp8|fp8_e4m3",
                help="auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3): keys and values "
                "in float8 e4m3 scaled by the checkpoint's k_scale/v_scale (else 1.0), twice "
                "the tokens of a 16-bit cache in the same memory (default auto)",
            ),
        ),
    ],
    "scheduler": [
        (
            "--max-num-seqs",
            "max_num_seqs",
            dict(type=int, help="most sequences in one step (default 256)"),
        ),
        (
            "--max-num-batched-tokens",
            "max_num_batched_tokens",
            dict(type=int, help="token budget of one step (default 2048 on CPU, 8192 on GPU)"),
        ),
        ("--scheduling-policy", "scheduling_policy", dict(choices=("fcfs", "priority"))),
        (
            "--async-scheduling",
            "async_scheduling",
            dict(
                action=argparse.BooleanOptionalAction,
                help="schedule the next step while the current one runs, overlapping the host's "
                "batch preparation with model execution (default: on with a GPU, off on "
                "the CPU, where the model runs on the same cores)",
            ),
        ),
        (
            "--stream-interval",
            "stream_interval",
            dict(
                type=int,
                help="tokens a streamed completion gathers per chunk: 1 streams every token, "
                "more saves the server work per token (the first token and the end go out at "
                "once; default 1)",
            ),
        ),
    ],
    "parallel": [
        (
            "--tensor-parallel-size",
            "tensor_parallel_size",
            dict(type=int, help="devices per model (default 1)"),
        ),
        (
            "--enable-expert-parallel",
            "enable_expert_parallel",
            dict(
                action="store_true",
                help="mixture-of-experts layers place whole experts on the tensor-parallel "
                "ranks instead of splitting each expert (default off; no effect on dense models)",
            ),
        ),
        (
            "--distributed-executor-backend",
            "distributed_executor_backend",
            dict(
                choices=EXECUTOR_BACKENDS,
                help="uni: worker in the engine process; mp: one process per rank; ray: one Ray "
                "actor per rank, across a Ray cluster's nodes (default: mp when TP > 1)",
            ),
        ),
        (
            "--data-parallel-size",
            "data_parallel_size",
            dict(
                type=int,
                help="engine cores (replicas) behind engine serve, each with its own "
                "workers; requests go to the least loaded (default 1)",
            ),
        ),
        (
            "--data-parallel-size-local",
            "data_parallel_size_local",
            dict(type=int, help="how many of the engine cores run on this host (default: all)"),
        ),
        (
            "--data-parallel-start-rank",
            "data_parallel_start_rank",
            dict(type=int, help="the DP rank of this host's first engine core (default 0)"),
        ),
        (
            "--data-parallel-address",
            "data_parallel_address",
            dict(
                help="address of the first host, where other hosts' engine cores register "
                "(default 127.0.0.1)"
            ),
        ),
        (
            "--data-parallel-rpc-port",
            "data_parallel_rpc_port",
            dict(
                type=int, help="port of that registration socket on the first host (default 29550)"
            ),
        ),
        (
            "--data-parallel-backend",
            "data_parallel_backend",
            dict(
                choices=DATA_PARALLEL_BACKENDS,
                help="mp: engine serve starts the engine cores (on other hosts: --headless); "
                "ray: each engine core in a Ray actor on a Ray cluster's nodes (default mp)",
            ),
        ),
    ],
    "observability": [
        (
            "--disable-log-stats",
            "disable_log_stats",
            dict(
                action="store_true", help="no periodic throughput log line (/metrics still counts)"
            ),
        ),
        (
            "--enable-log-requests",
            "enable_log_requests",
            dict(action="store_true", help="the API servers log every request they receive"),
        ),
        (
            "--disable-log-requests",
            "enable_log_requests",
            dict(action="store_false", help="log no requests (the default; vLLM's older flag)"),
        ),
        (
            "--max-log-len",
            "max_log_len",
            dict(type=int, help="characters of a request body a log line shows (default: all)"),
        ),
        (
            "--log-level",
            "log_level",
            dict(
                choices=LOG_LEVELS,
                help="every process's log level (default info); alias --uvicorn-log-level",
            ),
        ),
    ],
    "load": [
        ("--load-format", "load_format", dict(choices=LOAD_FORMATS, help="dummy: random weights")),
        ("--device", "device", dict(choices=DEVICES, help="auto: CUDA when present, else CPU")),
        (
            "--download-dir",
            "download_dir",
            dict(
                help="Hugging Face cache to find Hub models in and download them to (default: "
                "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)"
            ),
        ),
    ],
    "speculative": [
        (
            "--speculative-config",
            "speculative_config",
            dict(
                help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"model": '
                '"DRAFT", "num_speculative_tokens": 4}\' (methods: ngram, draft_model, eagle, '
                "eagle3; docs/speculative-decoding.md)"
            ),
        ),
    ],
}


# Second names of flags: vLLM's older or frontend spelling.
_ALIASES = {
    "--kv-cache-memory-bytes": ("--kv-cache-memory",),
    "--log-level": ("--uvicorn-log-level",),
}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's flags to parser, grouped; a flag left unset keeps the default.
    model_positional: the model may also come first, as in `engine serve MODEL`."""
    for group_name, flags in _GROUPS.items():
        group = parser.add_argument_group(f"{group_name} options")
        for flag, field, kwargs in flags:
            if flag == "--model" and model_positional:
                group.add_argument(
                    "model_tag",
                    nargs="?",
                    default=None,
                    metavar="MODEL",
                    help="the model, as --model gives it",
                )
            if flag in _ALIASES:
                kwargs = {**kwargs, "dest": field}
                group.add_argument(flag, *_ALIASES[flag], default=None, **kwargs)
                continue
            extra = {"--tensor-parallel-size": ("-tp",), "--data-parallel-size": ("-dp",)}.get(
                flag, ()
            )
            group.add_argument(flag, *extra, dest=field, default=None, **kwargs)
    add_vllm_only_args(parser, ENGINE_ONLY)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set, as keyword arguments for EngineConfig; ValueError
    for a vLLM flag this engine cannot honour, or two different models."""
    refuse_vllm_only(args, ENGINE_ONLY)
    fields = [field for flags in _GROUPS.values() for _, field, _ in flags]
    kwargs = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if kwargs.get("model", tag) != tag:
            raise ValueError(f"the model is given twice: {tag} and --model {kwargs['model']}")
        kwargs["model"] = tag
    return kwargs
