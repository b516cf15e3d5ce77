"""POST /v1/completions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from aiohttp import web

from frontend.errors import bad_request
from frontend.openai_protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, check_unsupported)
from frontend.response_format import requested_constraint
from frontend.serving import (ServingContext, json_response, merged_deltas, request_id,
                              prompt_logprobs_json, sampling_params, stream_sse, top_entries,
                              usage, widest_logprobs)
from tokenizer_proc.protocol import GenerateRequest, PositionLogprobs


def _token_ids(ids: list[int]) -> list[int]:
    """ids, refused with 400 beyond 64 bits (the IPC encoder's limit; the tokenizer process
    checks the vocabulary range)."""
    if any(not -2**63 <= t < 2**63 for t in ids):
        raise bad_request("token ids must be in the vocabulary range", "prompt")
    return list(ids)


def _prompts(prompt) -> list[str | list[int]]:
    """The prompt field as a list of prompts: each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_token_ids(prompt)]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if any(isinstance(p, list) and not p for p in prompt):
            raise bad_request("a token-id prompt must not be empty", "prompt")
        return [_token_ids(p) if isinstance(p, list) else p for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of lists of token ids", "prompt")


class _Logprobs:
    """Builds OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, k: int, offset: int = 0) -> None:
        self.k = k
        self.offset = offset

    def build(self, positions: list[PositionLogprobs | None], tokens: list[str] | None = None
              ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for i, position in enumerate(positions):
            if position is None:  # the first prompt token has no logprob
                token = tokens[i] if tokens else ""
                out.tokens.append(token)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                sampled = position[0]
                token = sampled.decoded_token or ""
                out.tokens.append(token)
                out.token_logprobs.append(sampled.logprob)
                top = {e.decoded_token or "": e.logprob for e in top_entries(position, self.k)}
                top.setdefault(token, sampled.logprob)
                out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(token)
        return out


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            http_request: web.Request) -> web.StreamResponse:
    check_unsupported(req)
    ctx.check_model(req.model)
    prompts = _prompts(req.prompt)
    k = req.logprobs
    params = sampling_params(req, req.max_tokens, logprobs=k, prompt_logprobs=widest_logprobs(
        req.prompt_logprobs, k if req.echo else None),
        structured_outputs=requested_constraint(req))
    base_id = request_id("cmpl", http_request)
    requests = [GenerateRequest(f"{base_id}-{i}", params,
                                prompt=p if isinstance(p, str) else None,
                                prompt_token_ids=p if isinstance(p, list) else None,
                                api_server_index=ctx.api_server_index, cache_salt=req.cache_salt,
                                priority=req.priority, arrival_time=time.time())
                for i, p in enumerate(prompts)]
    n = req.n
    created = int(time.time())
    echo_text: list[str] = []
    echo_tokens: list[list[str]] = []
    if req.echo:
        for p in prompts:
            ids = ctx.tokenizer(p).input_ids if isinstance(p, str) else p
            echo_text.append(p if isinstance(p, str) else ctx.tokenizer.decode(ids))
            echo_tokens.append([ctx.tokenizer.decode([ids[0]])] if ids else [""])
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] = {}
    builders: dict[int, _Logprobs] = {}
    started: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0

    def choice_of(prompt_index: int, delta) -> CompletionChoice:
        nonlocal completion_tokens
        index = prompt_index * n + delta.index
        prompt_tokens[prompt_index] = delta.num_prompt_tokens
        completion_tokens += len(delta.token_ids)
        if delta.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = delta.prompt_logprobs
        text = delta.text
        logprobs = None
        builder = builders.setdefault(index, _Logprobs(k or 0))
        first = index not in started
        if first:
            started.add(index)
            if req.echo:
                text = echo_text[prompt_index] + text
                if k is not None:
                    logprobs = builder.build(prompt_logprobs.get(prompt_index, [None]),
                                             echo_tokens[prompt_index])
        if k is not None:
            more = builder.build(delta.logprobs or [])
            if logprobs is None:
                logprobs = more
            else:
                for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, f).extend(getattr(more, f))
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        if first and req.prompt_logprobs is not None:  # not streamed (refused with stream)
            choice.prompt_logprobs = prompt_logprobs_json(
                prompt_logprobs.get(prompt_index, [None]), req.prompt_logprobs)
        return choice

    def current_usage():
        return usage(sum(prompt_tokens.values()), completion_tokens)

    deltas = merged_deltas(ctx, requests)
    if req.stream:
        opts = req.stream_options

        async def events() -> AsyncIterator[CompletionResponse]:
            async for prompt_index, delta in deltas:
                choice = choice_of(prompt_index, delta)
                yield CompletionResponse(
                    id=base_id, created=created, model=ctx.model_name, choices=[choice],
                    usage=current_usage() if opts and opts.continuous_usage_stats else None)
            if opts and opts.include_usage:
                yield CompletionResponse(id=base_id, created=created, model=ctx.model_name,
                                         choices=[], usage=current_usage())

        return await stream_sse(http_request, events())

    choices: dict[int, CompletionChoice] = {}
    async with contextlib.aclosing(deltas):  # a client gone (handler cancelled) aborts
        async for prompt_index, delta in deltas:
            choice = choice_of(prompt_index, delta)
            have = choices.get(choice.index)
            if have is None:
                choices[choice.index] = choice
                continue
            have.text += choice.text
            have.finish_reason, have.stop_reason = choice.finish_reason, choice.stop_reason
            if have.logprobs is not None and choice.logprobs is not None:
                for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(have.logprobs, f).extend(getattr(choice.logprobs, f))
    return json_response(CompletionResponse(
        id=base_id, created=created, model=ctx.model_name,
        choices=[choices[i] for i in sorted(choices)], usage=current_usage()))
