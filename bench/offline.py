"""`engine bench throughput`, `prefix-shared` and `null-model`: offline workloads of
shared/BENCHMARKS.md through `LLM.generate`, with transformers alongside."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.machine_limits import machine_info, matmul_rates, timed
from bench.moe_bytes import moe_step_bytes
from bench.overhead import step_overhead
from config.args import engine_kwargs
from protocol.sampling_params import SamplingParams

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


def random_prompts(
    tokenizer: PreTrainedTokenizerBase, rng: np.random.Generator, lengths: np.ndarray
) -> list[list[int]]:
    """Random token ids from the vocabulary, special tokens excluded."""
    special = set(tokenizer.all_special_ids)
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special])
    return [vocab[rng.integers(0, len(vocab), n)].tolist() for n in lengths]


def _flops_per_token(arch) -> tuple[float, float]:
    """Matmul FLOPs of one prompt token and one sampled token (adds the output projection);
    of a mixture of experts, the experts a token is routed to (norms counted as weights)."""
    h, i, kv = arch.hidden_size, arch.intermediate_size, arch.num_key_value_heads * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    body = 2 * arch.num_hidden_layers * per_layer
    if (moe := moe_step_bytes(arch, 1)) is not None:
        # A token runs its top_k experts of each MoE layer and every other weight once.
        routed = sum(layer.top_k * layer.bytes_per_expert for layer in moe.layers)
        body = 2 * (moe.other_bytes - h * arch.vocab_size + routed)
    return body, body + 2 * h * arch.vocab_size


def _hf_generate(
    model_path: str, prompts: list[list[int]], outputs: list[int], batch_size: int = 32
) -> float:
    """Seconds for transformers' batched greedy generate (left padding), batch by batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, lens = prompts[b : b + batch_size], outputs[b : b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, p in enumerate(batch):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            # One batch runs to its longest requested output; only requested tokens are counted.
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Workload offline-mixed: 64 requests at once, prompts 32..256, outputs 16..128 tokens."""
    from frontend.llm import LLM

    kwargs = engine_kwargs(args)
    if getattr(args, "small_moe", False):
        if "model" in kwargs:
            raise ValueError("--small-moe runs its own model: leave out --model")
        from bench.moe_model import small_moe_dir

        kwargs["model"] = small_moe_dir()
    llm = LLM(engine_process=not args.in_process, **kwargs)
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(32, 257, 64)
    output_lens = rng.integers(16, 129, 64).tolist()
    prompts = random_prompts(llm.get_tokenizer(), rng, prompt_lens)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    # Warm-up on other prompts: the measured ones must not start with their prefix cached.
    warm = random_prompts(llm.get_tokenizer(), np.random.default_rng(1), prompt_lens[:4])
    llm.generate([{"prompt_token_ids": p} for p in warm], params[:4], use_tqdm=False)
    elapsed = timed(
        lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    )
    n_out, n_in = sum(output_lens), int(prompt_lens.sum())
    flops_in, flops_out = _flops_per_token(llm.config.arch)
    matmul = matmul_rates()
    result: dict[str, Any] = {
        "workload": "offline-mixed",
        "machine": machine_info(),
        "model": llm.config.model_path,
        "engine_core": "in-process" if args.in_process else "own process",
        "dtype": llm.config.torch_dtype_name,
        "requests": len(prompts),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "engine_seconds": round(elapsed, 2),
        "engine_output_tok_s": round(n_out / elapsed, 1),
        "engine_total_tok_s": round((n_in + n_out) / elapsed, 1),
        "matmul_gflops": matmul,
        "fraction_of_matmul_limit": round(
            (n_in * flops_in + n_out * flops_out) / elapsed / (matmul["limit"] * 1e9), 3
        ),
        "fraction_of_torch_matmul": round(
            (n_in * flops_in + n_out * flops_out) / elapsed / (matmul["torch"] * 1e9), 3
        ),
    }
    if not args.no_hf:
        hf_seconds = _hf_generate(llm.config.model_path, prompts, output_lens)
        result.update(
            hf_seconds=round(hf_seconds, 2),
            hf_output_tok_s=round(n_out / hf_seconds, 1),
            output_ratio_vs_hf=round(hf_seconds / elapsed, 2),
        )
    return result


def bench_prefix_shared(args: argparse.Namespace) -> dict[str, Any]:
    """Workload prefix-shared: 64 requests sharing a 512-token prefix, 32 unique + 32 out."""
    from frontend.llm import LLM

    results: dict[str, Any] = {"workload": "prefix-shared", "machine": machine_info()}
    kwargs = engine_kwargs(args)
    for caching in (True, False):
        llm = LLM(**{**kwargs, "enable_prefix_caching": caching})
        rng = np.random.default_rng(0)
        prefix = random_prompts(llm.get_tokenizer(), rng, np.array([512]))[0]
        tails = random_prompts(llm.get_tokenizer(), rng, np.full(64, 32))
        prompts = [{"prompt_token_ids": prefix + t} for t in tails]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
        elapsed = timed(functools.partial(llm.generate, prompts, params, use_tqdm=False))
        totals = llm.get_engine_stats()
        stats = (totals["prefix_cache_queries"], totals["prefix_cache_hits"])
        key = "caching_on" if caching else "caching_off"
        results[key] = {
            "seconds": round(elapsed, 2),
            "total_tok_s": round(64 * (544 + 32) / elapsed, 1),
            "output_tok_s": round(64 * 32 / elapsed, 1),
            "prefix_cache_hit_rate": round(stats[1] / stats[0], 3) if stats[0] else 0.0,
        }
        llm.shutdown()
        del llm
    results["speedup"] = round(
        results["caching_off"]["seconds"] / results["caching_on"]["seconds"], 2
    )
    return results


def _null_model_dir() -> str:
    """A 2-layer, hidden-64 random model with the default tokenizer (written once to the cache)."""
    import shutil

    from config.default_model import cache_root, resolve_model_path

    target = cache_root() / "models" / "null-model"
    if not (target / "config.json").is_file():
        source = resolve_model_path(None)
        config = json.loads((source / "config.json").read_text())
        config.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        tmp = target.with_name("null-model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
            "generation_config.json",
        ):
            if (source / name).is_file():
                shutil.copy(source / name, tmp / name)
        tmp.rename(target)
    return str(target)


def bench_null_model(args: argparse.Namespace) -> dict[str, Any]:
    """Workload null-model: 256 concurrent requests (16 in, 128 out) on a tiny random model,
    with the engine core in-process and in its own process over ZeroMQ."""
    from frontend.llm import LLM

    kwargs = {
        **engine_kwargs(args),
        "model": _null_model_dir(),
        "load_format": "dummy",
        "max_num_seqs": 256,
        "max_model_len": 256,
    }
    result: dict[str, Any] = {"workload": "null-model", "machine": machine_info()}
    rng = np.random.default_rng(0)
    for label, own_process in (("in_process", False), ("zmq", True)):
        llm = LLM(engine_process=own_process, **kwargs)
        prompts = random_prompts(llm.get_tokenizer(), rng, np.full(256, 16))
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=128)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)
        batch = [{"prompt_token_ids": p} for p in prompts]
        runs = [
            timed(functools.partial(llm.generate, batch, params, use_tqdm=False))
            for _ in range(args.runs)
        ]
        seconds = statistics.median(runs)
        # Every request fits one batch: one prefill step, then one step per further token.
        result[label] = {
            "seconds": round(seconds, 3),
            "output_tok_s": round(256 * 128 / seconds, 1),
            "ms_per_step": round(seconds / 128 * 1e3, 2),
        }
        llm.shutdown()
    result["zmq_fraction_of_in_process"] = round(
        result["zmq"]["output_tok_s"] / result["in_process"]["output_tok_s"], 3
    )
    result["step_overhead"] = step_overhead(kwargs)
    return result
