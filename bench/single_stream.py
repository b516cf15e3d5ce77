"""Workload single-stream (shared/BENCHMARKS.md): one request, 32 random prompt tokens, 256
decoded greedily; decode tokens/s after the first token, the median of the runs.

`engine bench single-stream` measures it through the offline API (`LLM.generate`).
`python -m bench.single_stream` drives the model runner alone, one step at a time, beside
Hugging Face transformers' generate in the same process (alternating), and reports the ratio
and the fraction of the memory-bandwidth limit: the bytes a decode step reads (the weights, and
the KV cache of the step's context, the mean over the run's steps) at the read bandwidth
measured in the same run. With several
--dtype values (e.g. `--dtype auto float32`: a GGUF model's quantized weights, then the same
weights dequantized) each gets its own runner and the runs alternate between them. --parts
adds where a step's time goes: the fused decode step per part and thread (the kernels rebuilt
with their timing), the output projection and the rest of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench.machine_limits import machine_info, memory_read_gbps, timed
from bench.offline import random_prompts
from config.args import engine_kwargs
from engine_core.resolve import resolved_config
from gpu_worker.layers.linear import Linear
from gpu_worker.model_runner import ModelRunner
from protocol.sampling_params import SamplingParams
from protocol.step import CachedRequestData, NewRequestData, SchedulerOutput

PROMPT_TOKENS, NEW_TOKENS = 32, 256


def workload_prompt(tokenizer, prompt_tokens: int = PROMPT_TOKENS) -> list[int]:
    """The workload's prompt: random token ids of the vocabulary, special tokens excluded."""
    return random_prompts(tokenizer, np.random.default_rng(0), np.array([prompt_tokens]))[0]


def offline_decode(llm, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s after the first token through LLM.generate: a request of new_tokens
    tokens less one of a single token."""
    first = timed(
        lambda: llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
    )
    total = timed(
        lambda: llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens),
            use_tqdm=False,
        )
    )
    return (new_tokens - 1) / (total - first)


def bench_single_stream(args: argparse.Namespace) -> dict[str, Any]:
    """`engine bench single-stream`: the workload through the offline API, --runs times; with
    --speculative-config, the editing workload with and without it (bench/spec_workload.py)."""
    from frontend.llm import LLM

    if getattr(args, "speculative_config", None):
        from bench.spec_workload import bench_spec_single_stream

        return bench_spec_single_stream(args)

    llm = LLM(**engine_kwargs(args))
    prompt = workload_prompt(llm.get_tokenizer())
    runs = [offline_decode(llm, prompt, NEW_TOKENS) for _ in range(args.runs)]
    return {
        "workload": "single-stream",
        "machine": machine_info(),
        "dtype": llm.config.torch_dtype_name,
        "engine_decode_tok_s": round(statistics.median(runs), 2),
        "runs": [round(r, 2) for r in runs],
    }


def runner_decode(runner: ModelRunner, prompt: list[int], new_tokens: int, run_id: int) -> float:
    """Decode tokens/s after the first token, driving the runner one step at a time."""
    bs = runner.block_size
    req = f"r{run_id}"
    blocks = list(range(-(-(len(prompt) + new_tokens) // bs)))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req, prompt, params, blocks, 0)],
        num_scheduled_tokens={req: len(prompt)},
        total_num_scheduled_tokens=len(prompt),
    )
    runner.execute_model(first)
    start = time.perf_counter()
    for i in range(1, new_tokens):
        computed = len(prompt) + i - 1
        runner.execute_model(
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData([req], [[]], [computed]),
                num_scheduled_tokens={req: 1},
                total_num_scheduled_tokens=1,
            )
        )
    elapsed = time.perf_counter() - start
    runner.execute_model(SchedulerOutput(finished_req_ids=[req]))
    return (new_tokens - 1) / elapsed


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every weight used by matmuls (the output projection
    included, quantized ones as packed, each in the layout its method reads) and the norms; the
    embedding table is only gathered from."""
    embedding = model.model.embed_tokens.weight
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = {id(m.weight) for m in linears if m.weight is not None}
    # Norms and biases; each Linear's W counts below, as its method holds it.
    tensors = [p for p in model.parameters() if p is not embedding and id(p) not in held]
    linear_bytes = sum(m.method.nbytes(m) for m in linears)
    return linear_bytes + sum(t.numel() * t.element_size() for t in tensors)


def decode_kv_bytes(model: torch.nn.Module, context: float) -> float:
    """Bytes of KV cache a decode step at `context` tokens reads: every layer's keys and values
    of each position (the cache's element size)."""
    per_token = 0
    for attn in model.attention_layers():
        cache = attn.kv_cache
        per_token += 2 * attn.num_kv_heads * attn.head_dim * cache.element_size()
    return per_token * context


def hf_decode(model, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s after the first token of transformers' greedy generate."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
    return (new_tokens - 1) / (total - first)


class StepTimers:
    """Where a decode step's time goes, for the fastest run: the whole step, the fused layer stack
    (per part and thread where the kernels were built with DECODE_STACK_PROFILE), the output
    projection (logits, or the fused greedy head) and the rest (the runner's Python, sampling)."""

    def __init__(self, runner: ModelRunner) -> None:
        from kernels.decode_stack import DecodeStack

        self.seconds = {"fused layer stack": 0.0, "output projection": 0.0}
        self.best: dict[str, Any] | None = None
        self._best_rate = 0.0
        model = runner.model

        def timed_call(name, fn):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[name] += time.perf_counter() - start

            return call

        run = DecodeStack.run
        model.fused_decode.stack()  # built now, so its run can be wrapped
        if (stack := model.fused_decode.stack()) is not None:
            stack.run = timed_call("fused layer stack", run.__get__(stack))
        model.compute_logits = timed_call("output projection", model.compute_logits)
        model.greedy_tokens = timed_call("output projection", model.greedy_tokens)

    def start(self) -> None:
        from kernels.decode_stack import take_profile

        take_profile()
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def stop(self, rate: float, steps: int) -> None:
        from kernels.decode_stack import take_profile

        threads = take_profile()
        if rate <= self._best_rate:
            return
        self._best_rate = rate
        ms = {name: round(s / steps * 1e3, 3) for name, s in self.seconds.items()}
        ms["step"] = round(1e3 / rate, 3)
        ms["rest of the step"] = round(
            ms["step"] - ms["fused layer stack"] - ms["output projection"], 3
        )
        if threads is not None:
            count = min(torch.get_num_threads(), len(threads))
            ms["fused step parts, per thread"] = {
                name: " ".join(f"{threads[t][name] / steps * 1e3:.3f}" for t in range(count))
                for name in threads[0]
            }
        self.best = ms


def load_runner(model: str | None, dtype: str) -> ModelRunner:
    """A model runner of the model in dtype, its KV cache allocated (128 MiB)."""
    config = resolved_config(model=model, dtype=dtype, max_model_len=1024, kv_cache_memory="128MiB")
    runner = ModelRunner(config, torch.device(config.device_type))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.single_stream`: the model runner beside transformers; prints JSON."""
    from tokenizer_proc.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m bench.single_stream", description=__doc__)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default model)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        help="engine dtype(s); auto keeps a GGUF model quantized on the CPU",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time the parts of a step (kernels rebuilt with DECODE_STACK_PROFILE)",
    )
    args = parser.parse_args(argv)
    if args.parts:  # before the kernels are first loaded
        defines = os.environ.get("ENGINE_CPU_KERNEL_DEFINES", "")
        os.environ["ENGINE_CPU_KERNEL_DEFINES"] = f"{defines} DECODE_STACK_PROFILE".strip()

    runners = {dtype: load_runner(args.model, dtype) for dtype in args.dtype}
    config = next(iter(runners.values())).config
    prompt = workload_prompt(load_tokenizer(config.tokenizer_path), args.prompt_tokens)
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32).eval()
    for runner in runners.values():
        runner_decode(runner, prompt, 16, -1)  # warm-up
    ours: dict[str, list[float]] = {dtype: [] for dtype in runners}
    timers = {dtype: StepTimers(runner) for dtype, runner in runners.items()} if args.parts else {}
    theirs = []
    for run in range(args.runs):
        for dtype, runner in runners.items():
            if dtype in timers:
                timers[dtype].start()
            ours[dtype].append(runner_decode(runner, prompt, args.new_tokens, run))
            if dtype in timers:
                timers[dtype].stop(ours[dtype][-1], args.new_tokens - 1)
        if hf is not None:
            theirs.append(hf_decode(hf, prompt, args.new_tokens))
    gbps = memory_read_gbps()
    machine = {**machine_info(), "torch": torch.__version__}
    result = {
        "workload": "single-stream",
        "machine": machine,
        "model": config.model_path,
        "memory_read_gb_s": round(gbps, 1),
    }
    # A step decoding token i of the run attends to prompt + i positions (i = 1 .. new - 1).
    mean_context = args.prompt_tokens + args.new_tokens / 2
    for dtype, runner in runners.items():
        weight_bytes = decode_weight_bytes(runner.model)
        kv_bytes = decode_kv_bytes(runner.model, mean_context)
        limit = gbps * 1e9 / (weight_bytes + kv_bytes)
        median = statistics.median(ours[dtype])
        result[f"dtype={dtype}"] = {
            "dtype": runner.config.torch_dtype_name,
            "quantization": runner.config.model.quantization,
            "engine_decode_tok_s": round(median, 2),
            "engine_runs": [round(x, 2) for x in ours[dtype]],
            "weight_mb": round(weight_bytes / 1e6, 1),
            "kv_mb_mean": round(kv_bytes / 1e6, 1),
            "bandwidth_limit_tok_s": round(limit, 1),
            "fraction_of_limit": round(median / limit, 3),
            "fraction_weights_only": round(median * weight_bytes / (gbps * 1e9), 3),
        }
        if dtype in timers:
            result[f"dtype={dtype}"]["parts_ms_per_step"] = timers[dtype].best
        if theirs:
            result[f"dtype={dtype}"]["ratio_vs_hf"] = round(median / statistics.median(theirs), 2)
    if theirs:
        result["hf_decode_tok_s"] = round(statistics.median(theirs), 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
