"""use_beam_search on /v1/completions and /v1/chat/completions: frontend/beam_search.py's
algorithm driven through the tokenizer processes, one single-token request per live beam and
step (the engine's prefix cache shares the beams' common prefixes). n is the beam width, as in
vLLM; the answer has the n best beams of each prompt, best first."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from engine_core.validation import check_completion_fits
from frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from frontend.errors import bad_request
from frontend.openai_protocol import _SamplingFields
from frontend.serving import ServingContext, merged_deltas
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest


def beam_search_params(
    req: _SamplingFields, max_tokens: int | None, prompts: list[list[int]], max_model_len: int
) -> BeamSearchParams:
    """The request's BeamSearchParams; 400 when a prompt plus max_tokens exceeds the context
    (max_tokens unset: as many as the longest prompt leaves)."""
    if max_tokens is None:
        max_tokens = max_model_len - max(len(p) for p in prompts)
    for prompt in prompts:
        probe = EngineCoreRequest("", prompt, SamplingParams(max_tokens=max(1, max_tokens)))
        try:
            check_completion_fits(probe, SimpleNamespace(max_model_len=max_model_len))
        except ValueError as e:
            raise bad_request(str(e), "max_tokens") from None
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=0.0 if req.temperature is None else req.temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        raise bad_request(str(e), "n" if "beam_width" in str(e) else None) from None


async def run_beam_search(
    ctx: ServingContext,
    prompts: list[list[int]],
    params: BeamSearchParams,
    base_id: str,
    req: _SamplingFields,
) -> list[BeamSearchOutput]:
    """The best beams of every prompt; ApiError when a step's request is refused."""
    search = BeamSearch(prompts, params, ctx.tokenizer.eos_token_id)
    step = 0
    while beams := search.pending():
        live = [i for i, t in enumerate(beams) if len(t) < ctx.max_model_len]
        requests = [
            GenerateRequest(
                f"{base_id}-beam{step}-{i}",
                search.step_params,
                prompt_token_ids=beams[i],
                api_server_index=ctx.api_server_index,
                cache_salt=req.cache_salt,
                priority=req.priority,
                arrival_time=time.time(),
            )
            for i in live
        ]
        found: dict[int, dict[int, float]] = {}
        if requests:
            async for index, delta in merged_deltas(ctx, requests):
                if delta.logprobs:
                    found[live[index]] = {e.token_id: e.logprob for e in delta.logprobs[0]}
        search.advance([found.get(i) for i in range(len(beams))])
        step += 1
    skip = req.skip_special_tokens
    return search.results(lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=skip))


def beam_token_ids(
    outputs: list[BeamSearchOutput], prompts: list[list[int]]
) -> list[list[list[int]]]:
    """Per prompt, per beam: the generated token ids."""
    return [[s.tokens[len(p) :] for s in out.sequences] for out, p in zip(outputs, prompts)]


async def single_events(items: list[Any]) -> AsyncIterator[Any]:
    """A finished answer's chunks as a stream (beam search answers at the end)."""
    for item in items:
        yield item
