"""`engine bench device`: decode of a Llama-3-8B-shaped model (or another shape of SHAPES, such as
Qwen3-30B-A3B's mixture of experts) against the memory-bandwidth limit.

Batch-1 and batch-64 decode (by default) with dummy weights, driven through EngineCore with token
ids (no tokenizer), with and without async scheduling. A decode step reads every weight once and
each request's KV cache, so bytes per step / step time / bandwidth says how close a step comes to
the memory's limit. A mixture-of-experts step reads only the experts its tokens are routed to
(bench/moe_bytes.py counts them from the routing, or estimates them for uniform routing). The
bandwidth is a large device copy measured in the same run, or the GPU's nominal figure when that
is higher.

--quantization fp8,gptq,awq,gguf-Q4_K (any of them) and --kv-cache-dtype fp8 run each variant
after the dense model with the model's dtype and KV cache (the baseline) in the same run, each
run with its step time's ratio to the baseline's at the same batch size, graphs and scheduling.
fp8, gptq and awq quantize the dummy weights at load (round to nearest: fp8 per output channel,
gptq and awq 4-bit in groups of 128; config/quantization.py), gguf-TYPE reads a random GGUF file.

The `engine` command imports this module for its flags, so heavy imports (torch, numpy) wait for
the run, as in bench/serve.py.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.device_shapes import SHAPES, model_config, write_model_dir
from bench.device_variants import GGUF_TYPES, ratio, target_checks, variants_of
from bench.moe_bytes import engine_model, experts_hit_per_layer, moe_step_bytes
from config.args import context_length, engine_kwargs

logger = logging.getLogger(__name__)

# Nominal memory bandwidth (bytes/s) by GPU name, most specific first (torch reports the SXM
# H100 as "NVIDIA H100 80GB HBM3").
NOMINAL_BANDWIDTH = (
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("H200", 4.8e12),
)

# offline-mixed (shared/BENCHMARKS.md): requests, and the (low, high) prompt and output lengths.
_MIXED_REQUESTS, _MIXED_PROMPT, _MIXED_OUTPUT = 64, (32, 256), (16, 128)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WARMUP_PROMPT, _WARMUP_OUTPUT = 16, 4


# --quantization values: dummy weights quantized at load, or gguf-TYPE (a random GGUF file).
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's own flags (the engine's are added by the caller)."""
    parser.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=[1, 64],
        metavar="B[,B...]",
        help="concurrent requests decoding together (default 1,64)",
    )
    parser.add_argument(
        "--context-len",
        type=context_length,
        default=128,
        metavar="N",
        help="prompt tokens of each request, e.g. 128, 1k, 32k (default 128)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=64,
        metavar="N",
        help="tokens each request decodes (default 64)",
    )
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        help="model shape (default: llama3-8b on CUDA, small on the CPU)",
    )
    parser.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        help="the same as --quantization gguf-TYPE",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one engine only: CUDA graphs (where the device has them) and async scheduling "
        "on, and no offline-mixed run",
    )
    parser.add_argument("--output-json", help="also write the figures to this file")


def _int_list(value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,64, got {value!r}")
    return sizes


@contextmanager
def _quantized_model(directory: Path, shape: str, gguf_type: str) -> Iterator[tuple[str, int]]:
    """A random GGUF file of the shape (its path, and the bytes a decode step reads), with
    ENGINE_CACHE_DIR pointing at a cache that resolves it, while the context lasts."""
    from gguf import GGMLQuantizationType

    from bench.random_gguf import prepare_cache_dir, quantized_bytes_per_step, write_random_gguf

    qtype = GGMLQuantizationType[gguf_type]
    config = model_config(shape)
    previous = os.environ.get("ENGINE_CACHE_DIR")
    os.environ["ENGINE_CACHE_DIR"] = str(directory / "cache")
    try:
        began = time.perf_counter()
        path = write_random_gguf(directory / f"{shape}-{gguf_type}.gguf", config, qtype)
        prepare_cache_dir(path, config)
        logger.info("wrote %s in %.1f s", path.name, time.perf_counter() - began)
        dtype_bytes = _DTYPE_BYTES.get(config["torch_dtype"], 2)
        yield str(path), quantized_bytes_per_step(config, qtype, dtype_bytes)
    finally:
        if previous is None:
            os.environ.pop("ENGINE_CACHE_DIR", None)
        else:
            os.environ["ENGINE_CACHE_DIR"] = previous


def weight_bytes_per_step(arch, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads: every layer's projections and norms, the final
    norm and the output projection (the embedding table only one row per request: left out)."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    if arch.attention_bias:
        per_layer += q + 2 * kv
    return (arch.num_hidden_layers * per_layer + h + arch.vocab_size * h) * dtype_bytes


def model_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads from a loaded model: each Linear's W in the
    layout its method reads (quantized or not) and its bias, every other module's own
    parameters (norms), no embedding table (one row per request)."""
    from gpu_worker.layers.linear import Embedding, Linear

    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.method.nbytes(module)
            params = [] if module.bias is None else [module.bias]
        elif isinstance(module, Embedding):
            continue
        else:
            params = list(module.parameters(recurse=False))
        total += sum(p.numel() * p.element_size() for p in params)
    return total


def nominal_bandwidth(device_name: str) -> float | None:
    """The GPU's published memory bandwidth in bytes/s, or None when not known (and on CPUs)."""
    return next((bw for name, bw in NOMINAL_BANDWIDTH if name in device_name), None)


def _decode_run(
    core, tag: str, batch: int, context_len: int, output_len: int, rng
) -> tuple[list[float], list[int]]:
    """Run batch requests to completion; the arrival time and KV tokens read of every step that
    decoded one token for each of the batch's requests (prefill steps and the tail, where
    requests that started first have finished, are not such steps)."""
    from protocol.engine_core import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    vocab = core.config.arch.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    generated: dict[str, int] = {}
    for n in range(batch):
        req_id = f"{tag}-{n}"
        generated[req_id] = 0
        core.add_request(
            EngineCoreRequest(req_id, rng.integers(0, vocab, context_len).tolist(), params)
        )
    times: list[float] = []
    kv_tokens: list[int] = []
    while core.has_unfinished_requests():
        outputs = core.step().outputs
        now = time.perf_counter()
        if len(outputs) == batch and all(
            len(o.new_token_ids) == 1 and generated[o.request_id] for o in outputs
        ):
            # The step fed each request's last token, which attends to every earlier position.
            times.append(now)
            kv_tokens.append(sum(context_len + generated[o.request_id] for o in outputs))
        for o in outputs:
            generated[o.request_id] += len(o.new_token_ids)
    return times, kv_tokens


def _measure(
    core,
    async_scheduling: bool,
    batch: int,
    args: argparse.Namespace,
    rng,
    weight_bytes: int,
    kv_bytes_per_token: int,
    bandwidth: float,
) -> dict[str, Any]:
    _decode_run(
        core,
        f"warmup-{async_scheduling}-{batch}",
        batch,
        min(_WARMUP_PROMPT, args.context_len),
        _WARMUP_OUTPUT,
        rng,
    )
    times, kv_tokens = _decode_run(
        core, f"run-{async_scheduling}-{batch}", batch, args.context_len, args.output_len, rng
    )
    if len(times) < 2:
        raise ValueError(
            f"batch {batch}: fewer than two steps decoded the whole batch; raise "
            f"--output-len ({args.output_len}) or --max-num-batched-tokens"
        )
    # Steady state: the time between such steps (with async scheduling, their period).
    step_s = (times[-1] - times[0]) / (len(times) - 1)
    kv_bytes = sum(kv_tokens[1:]) / (len(kv_tokens) - 1) * kv_bytes_per_token
    step_bytes = weight_bytes + kv_bytes
    return {
        "batch_size": batch,
        "cuda_graphs": bool(core.config.cuda_graph_capture_sizes()),
        "async_scheduling": async_scheduling,
        "ms_per_step": round(step_s * 1e3, 3),
        "output_tok_s": round(batch / step_s, 1),
        "steps_timed": len(times) - 1,
        "kv_bytes_per_step": int(kv_bytes),
        "bytes_per_step": int(step_bytes),
        "fraction_of_bandwidth_limit": round(step_bytes / step_s / bandwidth, 3),
    }


def bench_device(args: argparse.Namespace) -> dict[str, Any]:
    """Decode at each batch size, with and without CUDA graphs (on CUDA) and async scheduling;
    ms per step and the fraction of the memory-bandwidth limit; then each quantized or fp8-KV
    variant the same way, with its ratios to the baseline."""
    import numpy as np
    import torch

    from bench.machine_limits import copy_bandwidth, machine_info
    from config.device import DeviceConfig
    from engine_core.resolve import resolved_config

    kwargs = engine_kwargs(args)
    for name in (
        "model",
        "tokenizer",
        "load_format",
        "max_model_len",
        "max_num_seqs",
        "async_scheduling",
    ):
        if name in kwargs:
            raise ValueError(
                f"engine bench device sets --{name.replace('_', '-')} itself (from "
                f"--shape, --context-len, --output-len and --batch-sizes; async "
                f"scheduling both off and on)"
            )
    variants = variants_of(kwargs, getattr(args, "gguf_type", None))
    if args.output_len < 3:
        raise ValueError(
            f"--output-len must be at least 3 to time decode steps, got {args.output_len}"
        )
    device_type = DeviceConfig(kwargs.get("device", "auto")).resolved()
    shape = args.shape or ("llama3-8b" if device_type == "cuda" else "small")
    # Measured before the model and KV cache take the device's memory.
    measured = copy_bandwidth(device_type, 2**30 if device_type == "cuda" else 2**28)
    device_name = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
    nominal = nominal_bandwidth(device_name) if device_type == "cuda" else None
    bandwidth = max(measured, nominal or 0.0)
    rng = np.random.default_rng(0)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engine-bench-device-")))
        # Room for offline-mixed's longest request too (prompt 256 + output 128).
        max_len = max(args.context_len + args.output_len, _MIXED_PROMPT[1] + _MIXED_OUTPUT[1])
        common = {
            **kwargs,
            "max_model_len": max_len,
            "max_num_seqs": max(*args.batch_sizes, _MIXED_REQUESTS),
        }
        dense = {"model": str(write_model_dir(tmp, shape)), "load_format": "dummy"}
        for variant in variants:  # what the engine refuses, refused before any run
            if variant["gguf_type"] is None:
                resolved_config(
                    **common,
                    **dense,
                    quantization=variant["quantization"],
                    kv_cache_dtype=variant["kv_cache_dtype"],
                )
        baseline = _runs_of_variant(
            {**common, **dense}, args, rng, bandwidth, device_type, None, weights_from_model=False
        )
        measured_variants: list[dict[str, Any]] = []
        for variant in variants:
            try:
                result = _runs_of_quantized(
                    variant, common, dense, stack, tmp, shape, args, rng, bandwidth, device_type
                )
            except Exception as exc:  # the other variants' figures still come back
                logger.exception("variant %s failed", variant["name"])
                measured_variants.append({**variant, "error": repr(exc)})
                continue
            same_weights = baseline["runs"]
            quantized = variant["quantization"] or variant["gguf_type"]
            if variant["kv_cache_dtype"] != "auto" and quantized:
                # The same weights with the model dtype's cache ran just before.
                same_weights = measured_variants[-1].get("runs", [])
            for run in result["runs"]:
                run["ms_ratio_to_baseline"] = ratio(run, baseline["runs"])
                if variant["kv_cache_dtype"] != "auto":
                    run["ms_ratio_to_same_weights"] = ratio(run, same_weights)
            measured_variants.append(
                {**variant, **result, "targets": target_checks(variant, result["runs"])}
            )
    config = baseline.pop("config")
    assert config.arch is not None
    return {
        "workload": "device",
        "machine": machine_info(),
        "device_type": device_type,
        "shape": shape,
        "dtype": config.torch_dtype_name,
        "layers": config.arch.num_hidden_layers,
        "hidden_size": config.arch.hidden_size,
        "block_size": config.cache.block_size,
        "context_len": args.context_len,
        "output_len": args.output_len,
        **baseline,
        "bandwidth_gb_s": {
            "measured_copy": round(measured / 1e9, 1),
            "nominal": round(nominal / 1e9, 1) if nominal else None,
            "limit": round(bandwidth / 1e9, 1),
        },
        "variants": [{k: v for k, v in m.items() if k != "config"} for m in measured_variants],
    }


def _runs_of_quantized(
    variant: dict[str, Any],
    common: dict[str, Any],
    dense: dict[str, Any],
    stack: ExitStack,
    tmp: Path,
    shape: str,
    args: argparse.Namespace,
    rng,
    bandwidth: float,
    device_type: str,
) -> dict[str, Any]:
    """_runs_of_variant for one variant: its weights (quantized at load, or a random GGUF file
    written for it) and KV cache dtype."""
    quantized_bytes = None
    engine_args = {**common, **dense, "kv_cache_dtype": variant["kv_cache_dtype"]}
    if variant["gguf_type"] is not None:
        model, quantized_bytes = stack.enter_context(
            _quantized_model(tmp, shape, variant["gguf_type"])
        )
        engine_args |= {"model": model, "quantization": "gguf"}
        del engine_args["load_format"]
    elif variant["quantization"] is not None:
        engine_args["quantization"] = variant["quantization"]
    return _runs_of_variant(
        engine_args,
        args,
        rng,
        bandwidth,
        device_type,
        quantized_bytes,
        weights_from_model=variant["quantization"] is not None or quantized_bytes is not None,
    )


def _runs_of_variant(
    engine_args: dict[str, Any],
    args: argparse.Namespace,
    rng,
    bandwidth: float,
    device_type: str,
    quantized_bytes: int | None,
    weights_from_model: bool,
) -> dict[str, Any]:
    """Every batch size on one engine per graph and scheduling mode: the runs, offline-mixed's,
    the weight and KV bytes a step reads, and the last engine's configuration."""
    from config.engine import engine_config_from_kwargs

    engine_args = dict(engine_args)
    block_size = engine_config_from_kwargs(**engine_args).cache.block_size
    # The largest batch at full length, or offline-mixed's requests at theirs.
    blocks_needed = max(
        max(args.batch_sizes) * -(-(args.context_len + args.output_len) // block_size),
        _MIXED_REQUESTS * -(-(_MIXED_PROMPT[1] + _MIXED_OUTPUT[1]) // block_size),
    )
    if "kv_cache_memory" not in engine_args and "num_gpu_blocks_override" not in engine_args:
        # Only what the largest batch needs: two engines never hold a device's worth each.
        engine_args["num_gpu_blocks_override"] = blocks_needed
    # Graphs exist on CUDA only; --enforce-eager keeps to the eager runs.
    graph_modes: tuple[bool, ...] = (True, False) if device_type == "cuda" else (True,)
    if engine_args.pop("enforce_eager", False):
        graph_modes = (True,)
    async_modes: tuple[bool, ...] = (False, True)
    if args.quick:  # graphs where there are any, async on
        graph_modes, async_modes = graph_modes[-1:], (True,)
    experts_hit: dict[int, tuple[list[float], str]] = {}
    runs: list[dict[str, Any]] = []
    mixed: list[dict[str, Any]] = []
    step_bytes: dict[str, Any] = {}
    for eager in graph_modes:
        for async_scheduling in async_modes:
            config = engine_config_from_kwargs(
                **engine_args, async_scheduling=async_scheduling, enforce_eager=eager
            )
            engine_runs, engine_mixed, step_bytes = _runs_of_one_engine(
                config,
                args,
                rng,
                bandwidth,
                blocks_needed,
                quantized_bytes,
                experts_hit,
                weights_from_model,
            )
            runs += engine_runs
            if engine_mixed is not None:
                mixed.append(engine_mixed)
    return {**step_bytes, "runs": runs, "offline_mixed": mixed, "config": config}


def _offline_mixed(core, rng) -> dict[str, Any]:
    """BENCHMARKS.md's offline-mixed shape on this model: 64 requests at once, prompts of
    32..256 random token ids, 16..128 greedy output tokens each; output and total tokens/s."""
    from protocol.engine_core import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    vocab = core.config.arch.vocab_size
    prompt_lens = rng.integers(_MIXED_PROMPT[0], _MIXED_PROMPT[1] + 1, _MIXED_REQUESTS)
    output_lens = rng.integers(_MIXED_OUTPUT[0], _MIXED_OUTPUT[1] + 1, _MIXED_REQUESTS)
    start = time.perf_counter()
    for n, (p, o) in enumerate(zip(prompt_lens, output_lens)):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(o))
        core.add_request(
            EngineCoreRequest(f"mixed-{n}", rng.integers(0, vocab, int(p)).tolist(), params)
        )
    while core.has_unfinished_requests():
        core.step()
    elapsed = time.perf_counter() - start
    n_out, n_in = int(output_lens.sum()), int(prompt_lens.sum())
    return {
        "cuda_graphs": bool(core.config.cuda_graph_capture_sizes()),
        "async_scheduling": core.config.scheduler.async_scheduling,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(n_out / elapsed, 1),
        "total_tok_s": round((n_in + n_out) / elapsed, 1),
    }


def _runs_of_one_engine(
    config,
    args: argparse.Namespace,
    rng,
    bandwidth: float,
    blocks_needed: int,
    quantized_bytes: int | None = None,
    experts_hit: dict[int, tuple[list[float], str]] | None = None,
    weights_from_model: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """Every batch size, then offline-mixed (not with --quick), on one EngineCore, which is
    shut down and freed afterwards; with the bytes a step reads. quantized_bytes: the weight
    bytes of a GGUF file's blocks; weights_from_model: count them in the loaded model's layouts
    instead (weights quantized at load; GGUF blocks, which CUDA re-lays for the int kernel).
    experts_hit: a mixture of experts' counts by
    batch size, kept across engines (the dummy weights are the same in each)."""
    import gc

    import torch

    from engine_core.engine_core import EngineCore

    core = EngineCore(config)
    try:
        if core.num_blocks < blocks_needed:
            raise ValueError(
                f"the KV cache holds {core.num_blocks} blocks of {config.cache.block_size} "
                f"tokens, fewer than the {blocks_needed} that batch {max(args.batch_sizes)} "
                f"of {args.context_len + args.output_len} tokens needs"
            )
        dtype_bytes = _DTYPE_BYTES[config.torch_dtype_name]
        weights = quantized_bytes or weight_bytes_per_step(config.arch, dtype_bytes)
        if weights_from_model:
            model = engine_model(core)
            if model is None:
                raise ValueError("weights quantized at load are counted in an in-process model")
            weights = model_weight_bytes(model)
        kv_bytes = 1 if config.cache.kv_cache_dtype == "fp8" else dtype_bytes
        kv_per_token = config.arch.kv_elements_per_token * kv_bytes
        moe = (
            moe_step_bytes(config.arch, dtype_bytes)
            if quantized_bytes is None and not weights_from_model
            else None
        )
        step_bytes = {
            # A mixture of experts' varies with the experts a step hits: each run gives its own.
            "weight_bytes_per_step": None if moe is not None else weights,
            "moe": None if moe is None else moe.summary(),
            "kv_bytes_per_token": kv_per_token,
        }
        runs = []
        for batch in args.batch_sizes:
            extra: dict[str, Any] = {}
            if moe is not None:
                hit, source = experts_hit_per_layer(
                    core,
                    moe,
                    batch,
                    functools.partial(
                        _decode_run, core, f"experts-{batch}", batch, args.context_len, 4, rng
                    ),
                    {} if experts_hit is None else experts_hit,
                )
                weights = moe.weight_bytes(hit)
                extra = {
                    "weight_bytes_per_step": weights,
                    "experts_hit_per_layer": round(sum(hit) / len(hit), 2),
                    "experts_hit_from": source,
                }
            run = _measure(
                core,
                config.scheduler.async_scheduling,
                batch,
                args,
                rng,
                weights,
                kv_per_token,
                bandwidth,
            )
            runs.append(run | extra)
        return runs, None if args.quick else _offline_mixed(core, rng), step_bytes
    finally:
        core.shutdown()
        del core
        gc.collect()
        if config.device_type == "cuda":
            torch.cuda.empty_cache()
