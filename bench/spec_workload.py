"""Workload single-stream-editing: one request that asks for a given text back with a few
spelling changes, decoded greedily, where the answer repeats the prompt and n-gram drafts pay.

`engine bench single-stream --speculative-config JSON` runs it through two offline engines in
one process, one without speculative decoding (the baseline) and one with the given config,
alternating run by run. Each engine core runs in this process and is stepped here, so a run's
decode time is read from the step that gave the request its first token to the step that gave
its last (no second, shorter request to subtract: on a shared box that difference is noise).
It reports the decode tokens/s of both (the median of --runs), their ratio and the ratio of the
best runs, whether the greedy tokens are identical, and the acceptance counts of the speculative
engine's steps over its timed runs (SchedulerStats.spec_decoding, what the vllm:spec_decode_*
counters sum).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from config.args import engine_kwargs

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


def decode_once(core, req_id: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One greedy request of new_tokens tokens (ignore_eos) to completion on an EngineCore:
    seconds and steps after its first token, its tokens, and its steps' speculative counts."""
    from protocol.engine_core import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    core.add_request(EngineCoreRequest(req_id, prompt, params))
    tokens: list[int] = []
    first_at = end_at = 0.0
    steps = 0
    counts: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: list[int] = []
    while core.has_unfinished_requests():
        out = core.step()
        now = time.perf_counter()
        spec = out.scheduler_stats.spec_decoding if out.scheduler_stats else None
        if spec is not None:
            counts["drafts"] += spec.num_drafts
            counts["draft_tokens"] += spec.num_draft_tokens
            counts["accepted_tokens"] += spec.num_accepted_tokens
            per_pos += [0] * (len(spec.num_accepted_tokens_per_pos) - len(per_pos))
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos[pos] += n
        for o in out.outputs:
            if o.new_token_ids:
                steps += bool(tokens)
                first_at = first_at if tokens else now
                tokens += o.new_token_ids
                end_at = now
    return {
        "seconds": end_at - first_at,
        "steps": steps,
        "tokens": tokens,
        "spec": {**counts, "accepted_per_pos": per_pos},
    }


def acceptance(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' speculative counts summed: vLLM's mean acceptance length (1 + accepted per
    draft, the bonus token included), acceptance rate and per-position acceptance rate."""
    drafts = sum(r["drafts"] for r in runs)
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    per_pos = [0] * max((len(r["accepted_per_pos"]) for r in runs), default=0)
    for r in runs:
        for pos, n in enumerate(r["accepted_per_pos"]):
            per_pos[pos] += n
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
    spec_llm = LLM(engine_process=False, **kwargs)
    base_kwargs = {k: v for k, v in kwargs.items() if k != "speculative_config"}
    base_llm = LLM(engine_process=False, **base_kwargs)
    cores = {"baseline": base_llm.engine_core, "spec": spec_llm.engine_core}
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "spec": []}
    try:
        prompt, new_tokens = editing_prompt(spec_llm.get_tokenizer())
        for name, core in cores.items():  # warm-up, not timed
            decode_once(core, f"{name}-warmup", prompt, 8)
        for i in range(args.runs):
            for name, core in cores.items():
                runs[name].append(decode_once(core, f"{name}-{i}", prompt, new_tokens))
    finally:
        base_llm.shutdown()
        spec_llm.shutdown()
    rates = {name: [(new_tokens - 1) / r["seconds"] for r in done] for name, done in runs.items()}
    base, spec = (statistics.median(rates[name]) for name in ("baseline", "spec"))
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
        # On a shared box bursts of other work slow whole runs: the best runs are the figure
        # least disturbed.
        "ratio_of_best": round(max(rates["spec"]) / max(rates["baseline"]), 3),
        "run_ratios": [round(s / b, 3) for s, b in zip(rates["spec"], rates["baseline"])],
        "baseline_runs": [round(r, 2) for r in rates["baseline"]],
        "spec_runs": [round(r, 2) for r in rates["spec"]],
        "spec_tokens_per_step": round(
            (new_tokens - 1) / statistics.median(r["steps"] for r in runs["spec"]), 3
        ),
        "greedy_tokens_identical": all(
            s["tokens"] == b["tokens"] for s, b in zip(runs["spec"], runs["baseline"])
        ),
        "spec_decoding": acceptance([r["spec"] for r in runs["spec"]]),
    }
