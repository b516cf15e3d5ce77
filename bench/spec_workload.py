"""Workload single-stream-editing: one request that asks for a given text back with a few
spelling changes, decoded greedily, where the answer repeats the prompt and n-gram drafts pay.

`engine bench single-stream --speculative-config JSON` runs it through two offline engines in
one process, one without speculative decoding (the baseline) and one with the given config,
alternating run by run; it reports the decode tokens/s of both after the first token (the
median of --runs), their ratio, whether the greedy tokens are identical, and the acceptance
counts of the speculative engine's vllm:spec_decode_* counters over its timed runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from config.args import engine_kwargs
from metrics.reader import Counter, Metric, Vector

WORKLOAD = "single-stream-editing"
# British spellings the model is asked to change: a handful of edits in a 260-token text.
EDIT_TEXT = (
    "The harbour town woke slowly. By the time the grey light reached the quay, the baker had "
    "already filled the window with loaves, and the smell of them travelled down the street to "
    "the fishermen mending their nets. Nobody in the town could remember a morning without that "
    "smell; it was as much a part of the place as the colour of the cliffs or the sound of the "
    "gulls. The travellers who arrived on the early ferry often stopped in front of the bakery "
    "before they had even found their lodgings, and the baker, who favoured the quiet ones, "
    "would hand them a roll without asking for payment. In the afternoon the children came "
    "out of school and ran along the harbour wall, and their neighbours called to them to be "
    "careful, which they never were. The town council had organised a festival for the end of "
    "the summer, with a parade, a competition for the best catch and a dance in the square. "
    "Everyone agreed that it was the highlight of the year, although the older residents "
    "complained about the noise and the younger ones about the music. When the festival was "
    "over and the visitors had gone, the town returned to its usual rhythm: the ferry, the "
    "bakery, the nets, the gulls and the grey light on the quay."
)
INSTRUCTION = (
    "Rewrite the following text with American spelling (harbour becomes harbor, colour "
    "becomes color, and so on). Change nothing else and reply with the rewritten text only."
)


def editing_prompt(tokenizer) -> tuple[list[int], int]:
    """The workload's prompt token ids (through the chat template when the tokenizer has one)
    and its output length: the text's own length in tokens, so the answer is the whole text."""
    from tokenizer_proc.tokenizer import apply_chat_template

    message = f"{INSTRUCTION}\n\n{EDIT_TEXT}"
    if tokenizer.chat_template is not None:
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": message}])
    else:
        prompt = tokenizer(message + "\n\n")["input_ids"]
    new_tokens = len(tokenizer(EDIT_TEXT, add_special_tokens=False)["input_ids"])
    return [int(t) for t in prompt], new_tokens


def timed_decode(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s after the first token (a request of new_tokens less one of a single
    token, as offline_decode) and the request's greedy tokens."""
    from protocol.sampling_params import SamplingParams

    request = {"prompt_token_ids": prompt}
    start = time.perf_counter()
    llm.generate(request, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    start = time.perf_counter()
    out = llm.generate(request, params, use_tqdm=False)
    total = time.perf_counter() - start
    return (new_tokens - 1) / (total - first), list(out[0].outputs[0].token_ids)


def spec_counts(metrics: list[Metric]) -> dict[str, Any]:
    """The vllm:spec_decode_* totals of a get_metrics() snapshot, summed over label sets."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: list[int] = []
    for m in metrics:
        if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode_num_"):
            key = m.name.removeprefix("vllm:spec_decode_num_")
            if key in totals:
                totals[key] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos += [0] * (len(m.values) - len(per_pos))
            for pos, n in enumerate(m.values):
                per_pos[pos] += n
    return {**totals, "accepted_per_pos": per_pos}


def acceptance(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the counters gained between two spec_counts: vLLM's mean acceptance length
    (1 + accepted per draft, the bonus token included), acceptance rate and per-position rate."""
    drafts = after["drafts"] - before["drafts"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    old = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    per_pos = [n - old[pos] for pos, n in enumerate(after["accepted_per_pos"])]
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "per_position_acceptance_rate": [round(n / drafts, 3) for n in per_pos] if drafts else [],
    }


def bench_spec_single_stream(args: argparse.Namespace) -> dict[str, Any]:
    """The editing workload through a baseline and a speculative engine, alternating."""
    from bench.machine_limits import machine_info
    from frontend.llm import LLM

    kwargs = engine_kwargs(args)
    own_process = not getattr(args, "in_process", False)
    spec_llm = LLM(engine_process=own_process, **kwargs)
    base_kwargs = {k: v for k, v in kwargs.items() if k != "speculative_config"}
    base_llm = LLM(engine_process=own_process, **base_kwargs)
    try:
        prompt, new_tokens = editing_prompt(spec_llm.get_tokenizer())
        for llm in (base_llm, spec_llm):  # warm-up, not timed
            timed_decode(llm, prompt, 8)
        before = spec_counts(spec_llm.get_metrics())
        base_runs: list[float] = []
        spec_runs: list[float] = []
        identical = True
        for _ in range(args.runs):
            rate, base_tokens = timed_decode(base_llm, prompt, new_tokens)
            base_runs.append(rate)
            rate, spec_tokens = timed_decode(spec_llm, prompt, new_tokens)
            spec_runs.append(rate)
            identical = identical and base_tokens == spec_tokens
        after = spec_counts(spec_llm.get_metrics())
    finally:
        base_llm.shutdown()
        spec_llm.shutdown()
    counts = acceptance(before, after)
    base, spec = statistics.median(base_runs), statistics.median(spec_runs)
    assert spec_llm.config.speculative is not None
    return {
        "workload": WORKLOAD,
        "machine": machine_info(),
        "dtype": spec_llm.config.torch_dtype_name,
        "speculative_config": dataclasses.asdict(spec_llm.config.speculative),
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "baseline_decode_tok_s": round(base, 2),
        "spec_decode_tok_s": round(spec, 2),
        "ratio": round(spec / base, 3),
        "run_ratios": [round(s / b, 3) for s, b in zip(spec_runs, base_runs)],
        "baseline_runs": [round(r, 2) for r in base_runs],
        "spec_runs": [round(r, 2) for r in spec_runs],
        "greedy_tokens_identical": identical,
        "spec_decoding": counts,
    }
