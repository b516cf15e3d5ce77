"""Command-line flags for the engine's configuration, with vLLM's names."""

from __future__ import annotations

import argparse
from typing import Any

from engine_core.config import (BLOCK_SIZES, DEVICES, DTYPES, EXECUTOR_BACKENDS, HASH_ALGOS, LOAD_FORMATS,
                                QUANTIZATIONS)


def context_length(value: str) -> int:
    """'4096', '32k' or '1m' -> tokens."""
    v = value.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(v[-1:], 1)
    try:
        return int(float(v[:-1] if scale > 1 else v) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid context length {value!r}") from None


# (flag, EngineConfig field, argparse keyword arguments); defaults live in the dataclasses.
_GROUPS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "model": [
        ("--model", "model", dict(help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")),
        ("--tokenizer", "tokenizer", dict(help="tokenizer directory (default: the model's)")),
        ("--served-model-name", "served_model_name", dict(help="name the API answers to")),
        ("--dtype", "dtype", dict(choices=DTYPES, help="auto: float32 on CPU, bfloat16 on GPU; an "
                                                    "explicit dtype without --quantization "
                                                    "dequantizes a GGUF model at load")),
        ("--quantization", "quantization",
         dict(choices=QUANTIZATIONS, help="gguf: keep a GGUF model's linear weights quantized (CPU, "
                                          "float32 activations; the default for GGUF models on "
                                          "CPU with --dtype auto)")),
        ("--max-model-len", "max_model_len", dict(type=context_length,
                                                  help="context length, prompt + output (e.g. 4096, 32k)")),
        ("--seed", "seed", dict(type=int, help="random seed (default 0)")),
        ("--max-logprobs", "max_logprobs", dict(type=int, help="largest logprobs a request may ask (default 20)")),
    ],
    "cache": [
        ("--block-size", "block_size", dict(type=int, choices=BLOCK_SIZES, help="tokens per KV block (default 16; up to 128 on CUDA)")),
        ("--enable-prefix-caching", "enable_prefix_caching",
         dict(action=argparse.BooleanOptionalAction, help="reuse KV of shared prompt prefixes (default on)")),
        ("--prefix-caching-hash-algo", "prefix_caching_hash_algo", dict(choices=HASH_ALGOS)),
        ("--gpu-memory-utilization", "gpu_memory_utilization",
         dict(type=float, help="fraction of GPU memory for weights, activations and KV cache (default 0.9)")),
        ("--kv-cache-memory", "kv_cache_memory",
         dict(help="KV cache size, e.g. 2GiB (default on CPU: 2GiB; on GPU: from utilization)")),
        ("--num-gpu-blocks-override", "num_gpu_blocks_override", dict(type=int, help="exact number of KV blocks")),
    ],
    "scheduler": [
        ("--max-num-seqs", "max_num_seqs", dict(type=int, help="most sequences in one step (default 256)")),
        ("--max-num-batched-tokens", "max_num_batched_tokens",
         dict(type=int, help="token budget of one step (default 2048 on CPU, 8192 on GPU)")),
        ("--scheduling-policy", "scheduling_policy", dict(choices=("fcfs", "priority"))),
        ("--async-scheduling", "async_scheduling",
         dict(action=argparse.BooleanOptionalAction,
              help="schedule the next step while the current one runs, overlapping the host's "
                   "batch preparation with model execution (default: on with a GPU, off on "
                   "the CPU, where the model runs on the same cores)")),
    ],
    "parallel": [
        ("--tensor-parallel-size", "tensor_parallel_size", dict(type=int, help="devices per model (default 1)")),
        ("--distributed-executor-backend", "distributed_executor_backend",
         dict(choices=EXECUTOR_BACKENDS,
              help="uni: worker in the engine process; mp: one process per rank (default: mp when TP > 1)")),
        ("--data-parallel-size", "data_parallel_size",
         dict(type=int, help="engine cores (replicas) behind engine serve, each with its own "
                             "workers; requests go to the least loaded (default 1)")),
        ("--data-parallel-size-local", "data_parallel_size_local",
         dict(type=int, help="how many of the engine cores run on this host (default: all)")),
        ("--data-parallel-start-rank", "data_parallel_start_rank",
         dict(type=int, help="the DP rank of this host's first engine core (default 0)")),
        ("--data-parallel-address", "data_parallel_address",
         dict(help="address of the first host, where other hosts' engine cores register "
                   "(default 127.0.0.1)")),
        ("--data-parallel-rpc-port", "data_parallel_rpc_port",
         dict(type=int, help="port of that registration socket on the first host (default 29550)")),
    ],
    "load": [
        ("--load-format", "load_format", dict(choices=LOAD_FORMATS, help="dummy: random weights")),
        ("--device", "device", dict(choices=DEVICES, help="auto: CUDA when present, else CPU")),
    ],
}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's flags to parser, grouped; a flag left unset keeps the default."""
    for group_name, flags in _GROUPS.items():
        group = parser.add_argument_group(f"{group_name} options")
        for flag, field, kwargs in flags:
            if flag == "--model" and model_positional:
                group.add_argument("model", nargs="?", default=None, help=kwargs["help"])
                continue
            extra = {"--tensor-parallel-size": ("-tp",),
                     "--data-parallel-size": ("-dp",)}.get(flag, ())
            group.add_argument(flag, *extra, dest=field, default=None, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set, as keyword arguments for EngineConfig."""
    fields = [field for flags in _GROUPS.values() for _, field, _ in flags]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
