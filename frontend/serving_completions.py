"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from frontend.errors import bad_request
from frontend.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    check_unsupported,
)
from frontend.response_format import load_grammar_library, requested_constraint
from frontend.serving import (
    ServingContext,
    json_response,
    merged_deltas,
    prompt_logprobs_json,
    request_id,
    sampling_params,
    stream_sse,
    top_entries,
    usage,
    widest_logprobs,
)
from frontend.serving_beam_search import (
    beam_search_params,
    beam_token_ids,
    run_beam_search,
    single_events,
)
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest, PositionLogprobs, RequestDelta
from tokenizer_proc.prompt_inputs import truncate_prompt

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


def _token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """ids, refused with 400 outside the vocabulary: before echo decodes them here, and the
    IPC encoder takes 64-bit integers only."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt"
        )
    return list(ids)


def _prompts(prompt, vocab_size: int) -> list[str | list[int]]:
    """The prompt field as a list of prompts: each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_token_ids(prompt, vocab_size)]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if any(isinstance(p, list) and not p for p in prompt):
            raise bad_request("a token-id prompt must not be empty", "prompt")
        return [_token_ids(p, vocab_size) if isinstance(p, list) else p for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a "
        "list of lists of token ids",
        "prompt",
    )


def _echoed(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str | list[int]], add_special_tokens: bool
) -> tuple[list[str], list[list[str]]]:
    """For echo: each prompt's text, and its first token's text (the logprobs' first entry)."""
    texts, first_tokens = [], []
    for p in prompts:
        ids = (
            tokenizer(p, add_special_tokens=add_special_tokens).input_ids
            if isinstance(p, str)
            else p
        )
        texts.append(p if isinstance(p, str) else tokenizer.decode(ids))
        first_tokens.append([tokenizer.decode([ids[0]])] if ids else [""])
    return texts, first_tokens


class _Logprobs:
    """Builds OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, k: int, offset: int = 0) -> None:
        self.k = k
        self.offset = offset

    def build(
        self, positions: Sequence[PositionLogprobs | None], tokens: list[str] | None = None
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


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, http_request: web.Request
) -> web.StreamResponse:
    """POST /v1/completions: validate the request and its prompts, build the sampling
    parameters and one tokenizer-process request per prompt, submit them, then stream the
    choices as they come or gather them into one response."""
    prompts = _validated_prompts(ctx, req)
    if req.use_beam_search:
        return await _beam_search(ctx, req, http_request, prompts)
    params = await _sampling_params(req)
    base_id = request_id("cmpl", http_request, req.request_id)
    requests = _generate_requests(ctx, req, base_id, prompts, params)
    answer = _CompletionAnswer(ctx, req, base_id)
    if req.echo:  # in a thread: a long prompt must not stall the other requests' streams
        answer.echo_text, answer.echo_tokens = await asyncio.to_thread(
            _echoed, ctx.tokenizer, prompts, req.add_special_tokens
        )
    deltas = merged_deltas(ctx, requests)
    if req.stream:
        return await stream_sse(http_request, answer.events(deltas))
    return json_response(await answer.response(deltas))


def _validated_prompts(ctx: ServingContext, req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts; 400 (404 for an unknown model) naming what is refused."""
    check_unsupported(req)
    ctx.check_model(req.model)
    return _prompts(req.prompt, ctx.vocab_size)


async def _sampling_params(req: CompletionRequest) -> SamplingParams:
    """The request's SamplingParams, with its structured output; echo with logprobs asks for
    the prompt's logprobs too. 400 naming a field that does not fit."""
    await load_grammar_library(req)
    return sampling_params(
        req,
        req.max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=widest_logprobs(req.prompt_logprobs, req.logprobs if req.echo else None),
        structured_outputs=requested_constraint(req),
    )


def _generate_requests(
    ctx: ServingContext,
    req: CompletionRequest,
    base_id: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
) -> list[GenerateRequest]:
    """One tokenizer-process request per prompt, '<base_id>-<prompt index>'."""
    return [
        GenerateRequest(
            f"{base_id}-{i}",
            params,
            prompt=p if isinstance(p, str) else None,
            prompt_token_ids=p if isinstance(p, list) else None,
            api_server_index=ctx.api_server_index,
            cache_salt=req.cache_salt,
            priority=req.priority,
            arrival_time=time.time(),
            add_special_tokens=req.add_special_tokens,
            return_prompt_token_ids=bool(req.return_token_ids),
        )
        for i, p in enumerate(prompts)
    ]


class _CompletionAnswer:
    """The choices of every prompt's completions built from their deltas (choice index =
    prompt index * n + completion index), with the usage; as a stream or one response."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, base_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.base_id = base_id
        self.created = int(time.time())
        # With echo: each prompt's text, and its first token's text (the logprobs' first entry).
        self.echo_text: list[str] = []
        self.echo_tokens: list[list[str]] = []
        self.completion_tokens = 0
        # Per prompt index, from its deltas:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.prompt_ids: dict[int, list[int]] = {}
        self.prompt_logprobs: dict[int, list[PositionLogprobs | None]] = {}
        # Per choice index: its logprobs so far (text offsets run on), and whether it started.
        self._builders: dict[int, _Logprobs] = {}
        self._started: set[int] = set()

    def _usage(self) -> UsageInfo:
        return usage(
            sum(self.prompt_tokens.values()),
            self.completion_tokens,
            sum(self.cached_tokens.values()) if self.ctx.enable_prompt_tokens_details else None,
        )

    def _account(self, prompt_index: int, delta: RequestDelta) -> None:
        self.prompt_tokens[prompt_index] = delta.num_prompt_tokens
        self.cached_tokens[prompt_index] = delta.num_cached_tokens
        if delta.prompt_token_ids is not None:
            self.prompt_ids[prompt_index] = delta.prompt_token_ids
        self.completion_tokens += len(delta.token_ids)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs

    def _choice_of(self, prompt_index: int, delta: RequestDelta) -> CompletionChoice:
        """One delta as a choice; a choice's first also carries its echoed prompt, its prompt
        logprobs and its prompt token ids when asked for."""
        self._account(prompt_index, delta)
        index = prompt_index * self.req.n + delta.index
        first = index not in self._started
        self._started.add(index)
        text = delta.text
        if first and self.req.echo:
            text = self.echo_text[prompt_index] + text
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=self._logprobs_of(index, prompt_index, delta, first),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        if first and self.req.prompt_logprobs is not None:  # not streamed (refused with stream)
            choice.prompt_logprobs = prompt_logprobs_json(
                self.prompt_logprobs.get(prompt_index, [None]), self.req.prompt_logprobs
            )
        if self.req.return_token_ids:
            choice.token_ids = list(delta.token_ids)
            if first:
                choice.prompt_token_ids = self.prompt_ids.get(prompt_index)
        return choice

    def _logprobs_of(
        self, index: int, prompt_index: int, delta: RequestDelta, first: bool
    ) -> CompletionLogprobs | None:
        """The delta's logprobs (None unless asked for), after the echoed prompt's on a
        choice's first delta; one builder per choice, so text offsets run on."""
        k = self.req.logprobs
        if k is None:
            return None
        builder = self._builders.setdefault(index, _Logprobs(k))
        if not (first and self.req.echo):
            return builder.build(delta.logprobs or [])
        logprobs = builder.build(
            self.prompt_logprobs.get(prompt_index, [None]), self.echo_tokens[prompt_index]
        )
        _extend_logprobs(logprobs, builder.build(delta.logprobs or []))
        return logprobs

    async def events(
        self, deltas: AsyncGenerator[tuple[int, RequestDelta], None]
    ) -> AsyncIterator[CompletionResponse]:
        """One chunk per delta, then (stream_options.include_usage) the usage."""
        opts = self.req.stream_options
        async for prompt_index, delta in deltas:
            yield CompletionResponse(
                id=self.base_id,
                created=self.created,
                model=self.ctx.model_name,
                choices=[self._choice_of(prompt_index, delta)],
                usage=self._usage() if opts and opts.continuous_usage_stats else None,
            )
        if opts and opts.include_usage:
            yield CompletionResponse(
                id=self.base_id,
                created=self.created,
                model=self.ctx.model_name,
                choices=[],
                usage=self._usage(),
            )

    async def response(
        self, deltas: AsyncGenerator[tuple[int, RequestDelta], None]
    ) -> CompletionResponse:
        """Every choice whole, once all have finished."""
        choices: dict[int, CompletionChoice] = {}
        async with contextlib.aclosing(deltas):  # a client gone (handler cancelled) aborts
            async for prompt_index, delta in deltas:
                choice = self._choice_of(prompt_index, delta)
                have = choices.get(choice.index)
                if have is None:
                    choices[choice.index] = choice
                else:
                    _extend(have, choice)
        return CompletionResponse(
            id=self.base_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=[choices[i] for i in sorted(choices)],
            usage=self._usage(),
        )


def _extend(have: CompletionChoice, more: CompletionChoice) -> None:
    """Append a later delta's choice to the choice gathered so far."""
    have.text += more.text
    have.finish_reason, have.stop_reason = more.finish_reason, more.stop_reason
    if have.token_ids is not None and more.token_ids is not None:
        have.token_ids.extend(more.token_ids)
    if have.logprobs is not None and more.logprobs is not None:
        _extend_logprobs(have.logprobs, more.logprobs)


def _extend_logprobs(have: CompletionLogprobs, more: CompletionLogprobs) -> None:
    for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(have, f).extend(getattr(more, f))


async def _beam_search(
    ctx: ServingContext,
    req: CompletionRequest,
    http_request: web.Request,
    prompts: list[str | list[int]],
) -> web.StreamResponse:
    """use_beam_search: the n best beams of each prompt (choice index = prompt index * n + i)."""
    ids = await asyncio.to_thread(
        lambda: [  # off the event loop, as for echo
            ctx.tokenizer(p, add_special_tokens=req.add_special_tokens).input_ids
            if isinstance(p, str)
            else p
            for p in prompts
        ]
    )
    try:
        ids = [truncate_prompt(p, req.truncate_prompt_tokens, ctx.max_model_len) for p in ids]
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None
    params = beam_search_params(req, req.max_tokens, ids, ctx.max_model_len)
    base_id = request_id("cmpl", http_request, req.request_id)
    outputs = await run_beam_search(ctx, ids, params, base_id, req)
    generated = beam_token_ids(outputs, ids)
    choices = []
    for i, (out, prompt) in enumerate(zip(outputs, ids)):
        for j, (beam, tokens) in enumerate(zip(out.sequences, generated[i])):
            choice = CompletionChoice(
                index=i * req.n + j,
                text=beam.text or "",
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
            if req.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = prompt, tokens
            choices.append(choice)
    used = usage(sum(map(len, ids)), sum(len(t) for beams in generated for t in beams))
    response = CompletionResponse(id=base_id, model=ctx.model_name, choices=choices, usage=used)
    if not req.stream:
        return json_response(response)
    chunks = [
        CompletionResponse(id=base_id, created=response.created, model=ctx.model_name, choices=[c])
        for c in choices
    ]
    if req.stream_options and req.stream_options.include_usage:
        chunks.append(
            CompletionResponse(
                id=base_id, created=response.created, model=ctx.model_name, choices=[], usage=used
            )
        )
    return await stream_sse(http_request, single_events(chunks))
