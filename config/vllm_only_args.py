"""vLLM's arguments that this engine has no setting for: each is refused with the reason, or,
where this engine already behaves as the value asks, accepted as a no-op.

The same table serves the command line (`engine serve`, `engine generate`, ...) and LLM(...)
keyword arguments; docs/serve.md lists it.
"""

from __future__ import annotations

import argparse
from typing import Any

ANY = "*"  # every value is a no-op

# name (vLLM's, as a keyword argument) -> (takes a value, values accepted as a no-op, why)
ENGINE_ONLY: dict[str, tuple[bool, tuple[str, ...], str]] = {
    "swap_space": (
        True,
        (ANY,),
        "preempted requests are recomputed, never swapped (vLLM V1 ignores it too)",
    ),
    "max_seq_len_to_capture": (
        True,
        (ANY,),
        "decode graphs are captured by batch size (--cuda-graph-sizes) and serve every context",
    ),
    "disable_custom_all_reduce": (
        False,
        (ANY,),
        "tensor-parallel all-reduce is always the collective library's (NCCL, gloo)",
    ),
    "tokenizer_mode": (
        True,
        ("auto", "hf"),
        "the tokenizer is always the model's Hugging Face tokenizer",
    ),
    "calculate_kv_scales": (
        False,
        (),
        "an fp8 KV cache's scales are the checkpoint's k_scale/v_scale (else 1.0), never "
        "computed from the first batch",
    ),
    "cpu_offload_gb": (True, ("0",), "weights are never offloaded to the CPU"),
    "pipeline_parallel_size": (
        True,
        ("1",),
        "there is no pipeline parallelism; use --tensor-parallel-size",
    ),
    "enable_chunked_prefill": (
        False,
        (ANY,),
        "prefills are always chunked by the step's token budget",
    ),
    "no_enable_chunked_prefill": (
        False,
        (),
        "prefills are always chunked by the step's token budget",
    ),
    "max_num_partial_prefills": (True, ("1",), "one prompt is chunked at a time"),
    "max_long_partial_prefills": (True, ("1",), "one prompt is chunked at a time"),
    "code_revision": (True, (), "a model's own code is never run"),
    "hf_overrides": (True, (), "the model's config.json is read as it is"),
    "skip_tokenizer_init": (False, (), "the tokenizer processes always load the tokenizer"),
    "enable_prompt_embeds": (False, (), "prompts are text or token ids"),
    "limit_mm_per_prompt": (True, (), "the engine runs text-only models"),
    "enable_lora": (False, (), "there are no LoRA adapters"),
    "max_loras": (True, (), "there are no LoRA adapters"),
    "max_lora_rank": (True, (), "there are no LoRA adapters"),
    "compilation_config": (
        True,
        (),
        "the model runs without torch.compile; CUDA graphs are set by --cuda-graph-sizes "
        "and --enforce-eager",
    ),
    "kv_transfer_config": (True, (), "there is no KV transfer between instances"),
    "logits_processors": (True, (), "there are no custom logits processors"),
    "scheduler_cls": (True, (), "the scheduler is not replaceable"),
    "worker_cls": (True, (), "the worker is not replaceable"),
    "worker_extension_cls": (True, (), "the worker is not replaceable"),
    "otlp_traces_endpoint": (True, (), "there is no OpenTelemetry tracing; see /metrics"),
    "collect_detailed_traces": (True, (), "there is no OpenTelemetry tracing; see /metrics"),
    "long_prefill_token_threshold": (True, ("0",), "one prompt is chunked at a time"),
    "disable_chunked_mm_input": (False, (ANY,), "the engine runs text-only models"),
    "disable_hybrid_kv_cache_manager": (False, (ANY,), "one KV cache manager serves every layer"),
    "disable_cascade_attn": (False, (ANY,), "there is no cascade attention"),
    "max_parallel_loading_workers": (True, (ANY,), "each worker loads its own shard"),
    "use_tqdm_on_load": (False, (ANY,), "loading shows no progress bar"),
    "safetensors_load_strategy": (True, ("lazy",), "safetensors files are memory-mapped"),
    "model_impl": (True, ("auto", "vllm"), "models run with the engine's own implementations"),
    "config_format": (True, ("auto", "hf"), "the model's config.json is read"),
    "hf_config_path": (True, (), "the model's config.json is read from its folder"),
    "runner": (True, ("auto", "generate"), "the engine runs generative models only"),
    "convert": (True, ("auto", "none"), "the engine runs generative models only"),
    "ignore_patterns": (
        True,
        ("original/**/*",),
        "a Hub model's download takes config.json, generation_config.json, the tokenizer and "
        "the top-level *.safetensors only (never original/ or *.bin)",
    ),
    "model_loader_extra_config": (True, (), "the loader takes no extra settings"),
    "logits_processor_pattern": (True, (), "there are no custom logits processors"),
    "allowed_local_media_path": (True, (), "the engine runs text-only models"),
    "allowed_media_domains": (True, (), "the engine runs text-only models"),
    "mm_processor_kwargs": (True, (), "the engine runs text-only models"),
    "io_processor_plugin": (True, (), "there are no IO processor plugins"),
    "kv_offloading_size": (True, (), "the KV cache is not offloaded"),
    "kv_offloading_backend": (True, (), "the KV cache is not offloaded"),
    "kv_sharing_fast_prefill": (False, (), "layers do not share KV caches"),
    "kv_events_config": (True, (), "there are no KV cache events"),
    "nnodes": (
        True,
        ("1",),
        "tensor-parallel ranks span hosts only as Ray actors "
        "(--distributed-executor-backend ray); or run --headless hosts",
    ),
    "node_rank": (
        True,
        ("0",),
        "tensor-parallel ranks span hosts only as Ray actors (--distributed-executor-backend ray)",
    ),
    "master_addr": (
        True,
        (),
        "tensor-parallel ranks span hosts only as Ray actors (--distributed-executor-backend ray)",
    ),
    "master_port": (
        True,
        (),
        "tensor-parallel ranks span hosts only as Ray actors (--distributed-executor-backend ray)",
    ),
    "enable_eplb": (False, (), "the engine runs dense models (no MoE)"),
    "decode_context_parallel_size": (True, ("1",), "there is no context parallelism"),
    "enable_mfu_metrics": (False, (), "there are no MFU metrics"),
    "kv_cache_metrics": (False, (), "there are no KV block residency metrics"),
    "cudagraph_metrics": (False, (), "there are no CUDA graph metrics"),
    "profiler_config": (True, (), "there is no built-in profiler route"),
    "additional_config": (True, (), "there are no platform plugins"),
}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_vllm_only_args(
    parser: argparse.ArgumentParser, table: dict[str, tuple[bool, tuple[str, ...], str]]
) -> None:
    """Accept table's flags (hidden from --help), so refuse_vllm_only can say why."""
    group = parser.add_argument_group("vLLM options this engine does not have (docs/serve.md)")
    for name, (takes_value, _, _) in table.items():
        if takes_value:
            group.add_argument(
                flag_name(name), dest=f"vllm_only_{name}", default=None, help=argparse.SUPPRESS
            )
        else:
            group.add_argument(
                flag_name(name),
                dest=f"vllm_only_{name}",
                action="store_const",
                const="true",
                default=None,
                help=argparse.SUPPRESS,
            )


def refusals(
    given: dict[str, Any],
    table: dict[str, tuple[bool, tuple[str, ...], str]],
    as_flags: bool = True,
) -> list[str]:
    """One message per argument of table in given (name -> value) that is not a no-op."""
    out = []
    for name, value in given.items():
        if name not in table or value is None:
            continue
        takes_value, accepted, why = table[name]
        text = str(value).lower()
        if (
            ANY in accepted
            or text in accepted
            or (not takes_value and not accepted and text in ("false", "0"))
        ):
            continue
        shown = flag_name(name) if as_flags else name
        if takes_value:
            shown += f" {value}" if as_flags else f"={value!r}"
            if accepted:
                why += f" (it takes only {' or '.join(accepted)})"
        out.append(f"{shown} is not supported: {why}")
    return out


def refuse_vllm_only(
    args: argparse.Namespace, table: dict[str, tuple[bool, tuple[str, ...], str]]
) -> None:
    """ValueError naming every flag of table given with a value this engine cannot honour."""
    given = {name: getattr(args, f"vllm_only_{name}", None) for name in table}
    messages = refusals(given, table)
    if messages:
        raise ValueError("; ".join(messages))
