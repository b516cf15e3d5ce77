"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from frontend.errors import bad_request
from frontend.harmony_prompt import REASONING_EFFORTS
from frontend.openai_protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    TopLogprob,
    UsageInfo,
    check_unsupported,
)
from frontend.reasoning.chat import ChatReasoning, chat_reasoning, content_delta
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
)
from frontend.serving_beam_search import (
    beam_search_params,
    beam_token_ids,
    run_beam_search,
    single_events,
)
from frontend.serving_harmony import (
    HarmonyChoice,
    check_request,
    harmony_message,
    prompt_token_ids,
    refuse_constraint,
    tools_for_prompt,
    with_stop_tokens,
)
from frontend.tool_parsers.openai_calls import StreamedCalls, finish_reason, message_calls
from frontend.tool_parsers.tool_choice import ToolChoice, resolve_tool_choice
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest, PositionLogprobs, RequestDelta
from tokenizer_proc.prompt_inputs import truncate_prompt
from tokenizer_proc.tokenizer import apply_chat_template, check_chat_template_kwargs

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: list[ChatMessage], field: str = "messages") -> list[dict[str, Any]]:
    """OpenAI messages as the dicts the tokenizer process renders; 400 naming what is refused."""
    if not messages:
        raise bad_request("messages must not be empty", field)
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if m.role not in ROLES:
            raise bad_request(
                f"unsupported role {m.role!r} in {where}; supported: {', '.join(ROLES)}",
                f"{where}.role",
            )
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise bad_request("only tool messages carry tool_call_id", f"{where}.tool_call_id")
        for name in ("reasoning", "reasoning_content"):
            if getattr(m, name) is not None and m.role != "assistant":
                raise bad_request(f"only assistant messages carry {name}", f"{where}.{name}")
        content: Any = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"unsupported content part type {part.type!r}; only "
                        "'text' parts are supported",
                        f"{where}.content[{j}].type",
                    )
                parts.append({"type": "text", "text": part.text})
            content = parts
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        for name in ("name", "tool_call_id", "tool_calls", "reasoning", "reasoning_content"):
            if getattr(m, name) is not None:
                msg[name] = msgspec.to_builtins(getattr(m, name))
        out.append(msg)
    return out


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs, or 400 when one collides with the server's own arguments."""
    try:
        check_chat_template_kwargs(kwargs)
    except ValueError as e:
        raise bad_request(str(e), "chat_template_kwargs") from None
    return kwargs


def _logprobs(positions: list[PositionLogprobs], k: int) -> ChatChoiceLogprobs:
    content = []
    for position in positions:
        sampled = position[0]
        token = sampled.decoded_token or ""
        content.append(
            ChatLogprob(
                token=token,
                logprob=sampled.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token or "",
                        logprob=e.logprob,
                        bytes=list((e.decoded_token or "").encode()),
                    )
                    for e in top_entries(position, k)
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


def _message_role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """The answer's role: --response-role, or the continued message's own (vLLM's rule)."""
    return ctx.response_role if req.add_generation_prompt else req.messages[-1].role


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, http_request: web.Request
) -> web.StreamResponse:
    """POST /v1/chat/completions: validate the request, resolve its tools, build its sampling
    parameters and the tokenizer process's request (which renders the chat template), submit
    it, then stream the answer's chunks or gather them into one response."""
    messages = _validated_messages(ctx, req)
    if ctx.harmony is not None:  # gpt-oss: harmony reads its calls (serving_harmony)
        check_request(req)
        harmony_tools = tools_for_prompt(req)
        tools = ToolChoice(harmony_tools, parallel=req.parallel_tool_calls)
    else:
        tools = resolve_tool_choice(
            req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_parser
        )
    params = await _sampling_params(req, tools)
    reasoning = chat_reasoning(  # --reasoning-parser: structured outputs after the reasoning
        ctx.reasoning_parser, req.chat_template_kwargs, req.include_reasoning, params
    )
    if req.use_beam_search:
        return await _beam_search(ctx, req, http_request, messages, _max_tokens(req))
    if ctx.harmony is not None:
        refuse_constraint(params.structured_outputs)
        prompt = await prompt_token_ids(ctx.harmony, req, messages, harmony_tools)
        request = _generate_request(
            ctx, req, http_request, None, with_stop_tokens(params, ctx.harmony), tools, prompt
        )
    else:
        request = _generate_request(ctx, req, http_request, messages, params, tools)
    answer = _ChatAnswer(ctx, req, tools, request.request_id, reasoning)
    deltas = merged_deltas(ctx, [request])
    if req.stream:
        return await stream_sse(http_request, answer.chunks(deltas))
    return json_response(await answer.response(deltas))


def _validated_messages(ctx: ServingContext, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the tokenizer process renders them; 400 (404 for an unknown
    model) naming what is refused."""
    check_unsupported(req)
    ctx.check_model(req.model)
    messages = chat_messages(req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request(
            f"top_logprobs must be non-negative, got {req.top_logprobs}", "top_logprobs"
        )
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message are mutually "
            "exclusive; set add_generation_prompt to false",
            "continue_final_message",
        )
    if req.reasoning_effort not in (None, *REASONING_EFFORTS):
        raise bad_request(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
            f"{req.reasoning_effort!r}",
            "reasoning_effort",
        )
    return messages


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    """How many alternatives each sampled token's logprobs list; None: no logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, or the older max_tokens."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


async def _sampling_params(req: ChatCompletionRequest, tools: ToolChoice) -> SamplingParams:
    """The request's SamplingParams, with its structured output (response_format, or the
    grammar a required tool call imposes); 400 naming a field that does not fit."""
    await load_grammar_library(req, tools.constraint)
    constraint = requested_constraint(req, tools.constraint)
    params = sampling_params(
        req,
        _max_tokens(req),
        logprobs=_top_logprobs(req),
        prompt_logprobs=req.prompt_logprobs,
        structured_outputs=constraint,
    )
    if tools.keep_special_tokens:
        params.skip_special_tokens = False
    return params


def _generate_request(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    http_request: web.Request,
    messages: list[dict[str, Any]] | None,
    params: SamplingParams,
    tools: ToolChoice,
    prompt_token_ids: list[int] | None = None,
) -> GenerateRequest:
    """What the tokenizer process receives: the messages and what its chat template needs, or
    the prompt rendered here (gpt-oss)."""
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None and "reasoning_effort" not in (kwargs or {}):
        kwargs = {**(kwargs or {}), "reasoning_effort": req.reasoning_effort}  # as vLLM passes it
    return GenerateRequest(
        request_id("chatcmpl", http_request, req.request_id),
        params,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template=req.chat_template,
        api_server_index=ctx.api_server_index,
        cache_salt=req.cache_salt,
        priority=req.priority,
        arrival_time=time.time(),
        tools=tools.tools,
        chat_template_kwargs=template_kwargs(kwargs) if messages is not None else None,
        add_special_tokens=req.add_special_tokens,
        return_prompt_token_ids=bool(req.return_token_ids),
    )


@dataclass
class _GatheredChoice:
    """One choice of a response that is not streamed, as its deltas arrive."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _ChatAnswer:
    """One chat completion's answer built from its deltas: the usage counts, the prompt's
    token ids, each choice's tool calls; as a stream of chunks or as one response."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ChatCompletionRequest,
        tools: ToolChoice,
        base_id: str,
        reasoning: ChatReasoning | None = None,
    ) -> None:
        self.ctx = ctx
        self.reasoning = reasoning  # --reasoning-parser's split of each choice
        self.req = req
        self.tools = tools
        self.base_id = base_id
        self.k = _top_logprobs(req)
        self.role = _message_role(ctx, req)
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prompt_ids: list[int] | None = None  # with return_token_ids: once known
        # Streaming: each choice's tool-call parser (None: its text is content).
        self._calls: dict[int, StreamedCalls | None] = {}
        self._harmony: dict[int, HarmonyChoice] = {}  # streaming gpt-oss: each choice's reader

    def _account(self, delta: RequestDelta) -> None:
        self.prompt_tokens = delta.num_prompt_tokens
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = delta.num_cached_tokens
        if delta.prompt_token_ids is not None and self.prompt_ids is None:
            self.prompt_ids = delta.prompt_token_ids

    def _usage(self) -> UsageInfo:
        return usage(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens if self.ctx.enable_prompt_tokens_details else None,
        )

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.req.return_token_ids else None

    # ---- streamed ----

    async def chunks(
        self, deltas: AsyncGenerator[tuple[int, RequestDelta], None]
    ) -> AsyncIterator[ChatCompletionChunk]:
        """The answer's chunks: each choice's role first, then its content or tool-call
        pieces, then (stream_options.include_usage) the usage."""
        opts = self.req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        first = True
        async for _, delta in deltas:
            self._account(delta)
            if first:  # the role, in its own first chunk per choice, as OpenAI sends it
                first = False
                for i in range(self.req.n):
                    role_chunk = self._chunk(
                        [ChatStreamChoice(index=i, delta=ChatDelta(role=self.role, content=""))],
                        continuous,
                    )
                    if i == 0 and self.prompt_ids is not None:
                        role_chunk.prompt_token_ids = self.prompt_ids
                    yield role_chunk
            for choice in self._stream_choices(delta):
                yield self._chunk([choice], continuous)
        if opts and opts.include_usage:
            yield self._chunk([], True)

    def _chunk(
        self, choices: list[ChatStreamChoice], with_usage: bool = False
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.base_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=self._usage() if with_usage else None,
        )

    def _stream_choices(self, delta: RequestDelta) -> list[ChatStreamChoice]:
        """One engine delta as chunk choices: its text, or its content and call pieces."""
        logprobs = _logprobs(delta.logprobs or [], self.k) if self.k is not None else None
        if self.ctx.harmony is not None:
            return self._harmony_choices(delta, logprobs)
        if delta.index not in self._calls:
            parser = self.tools.new_parser()
            self._calls[delta.index] = (
                None if parser is None else StreamedCalls(parser, self.tools.parallel)
            )
        calls = self._calls[delta.index]
        head, text = None, delta.text  # the reasoning piece, then the answer's text
        if self.reasoning is not None:
            head, text = self.reasoning.stream_delta(delta.index, delta.text, delta.finished)
        if calls is None:
            return [
                ChatStreamChoice(
                    index=delta.index,
                    delta=content_delta(head, text),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    token_ids=self._token_ids(delta.token_ids),
                )
            ]
        pieces = ([head] if head else []) + calls.deltas(text, delta.finished)
        if not pieces and (delta.finished or logprobs is not None):
            pieces = [ChatDelta()]
        out = [ChatStreamChoice(index=delta.index, delta=piece) for piece in pieces]
        if out:
            out[0].logprobs = logprobs
            out[0].token_ids = self._token_ids(delta.token_ids)
            out[-1].finish_reason = finish_reason(delta.finish_reason, calls.called)
            out[-1].stop_reason = delta.stop_reason
        return out

    def _harmony_choices(
        self, delta: RequestDelta, logprobs: ChatChoiceLogprobs | None
    ) -> list[ChatStreamChoice]:
        """One engine delta of a gpt-oss answer: its reasoning, content and call pieces."""
        assert self.ctx.harmony is not None
        choice = self._harmony.get(delta.index)
        if choice is None:
            choice = self._harmony[delta.index] = HarmonyChoice(
                self.ctx.harmony, self.tools.parallel, self.req.include_reasoning
            )
        pieces = choice.deltas(delta.token_ids, delta.finished)
        if not pieces and (delta.finished or logprobs is not None or self.req.return_token_ids):
            pieces = [ChatDelta()]
        out = [ChatStreamChoice(index=delta.index, delta=piece) for piece in pieces]
        if out:
            out[0].logprobs = logprobs
            out[0].token_ids = self._token_ids(delta.token_ids)
            out[-1].finish_reason = finish_reason(delta.finish_reason, choice.called)
            out[-1].stop_reason = delta.stop_reason
        return out

    # ---- gathered ----

    async def response(
        self, deltas: AsyncGenerator[tuple[int, RequestDelta], None]
    ) -> ChatCompletionResponse:
        """The whole answer, once every choice has finished."""
        choices: dict[int, _GatheredChoice] = {}
        prompt_positions = None
        async with contextlib.aclosing(deltas):  # a client gone (handler cancelled) aborts
            async for _, delta in deltas:
                self._account(delta)
                if delta.prompt_logprobs is not None and prompt_positions is None:
                    prompt_positions = delta.prompt_logprobs
                choice = choices.setdefault(delta.index, _GatheredChoice())
                choice.texts.append(delta.text)
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs or [])
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
        prompt_lps = None
        if self.req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_json(prompt_positions or [None], self.req.prompt_logprobs)
        return ChatCompletionResponse(
            id=self.base_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=[self._choice(i, choices[i]) for i in sorted(choices)],
            usage=self._usage(),
            prompt_logprobs=prompt_lps,
            prompt_token_ids=self.prompt_ids,
        )

    def _choice(self, index: int, gathered: _GatheredChoice) -> ChatChoice:
        """One choice of the response, its tool calls parsed out of its text."""
        text = "".join(gathered.texts)
        reason = gathered.finish_reason
        message = ChatResponseMessage(role=self.role, content=text)
        if self.reasoning is not None:  # the tool calls are read from the answer only
            message = self.reasoning.message(self.role, text)
            text = message.content or ""
        parser = self.tools.new_parser(eager=False)
        if self.ctx.harmony is not None:
            message = harmony_message(
                self.ctx.harmony,
                gathered.token_ids,
                self.role,
                self.tools.parallel,
                self.req.include_reasoning,
            )
            reason = finish_reason(reason, message.tool_calls is not None)
        elif parser is not None:
            extracted = parser.extract(text)
            message.content = extracted.content
            message.tool_calls = message_calls(extracted, self.tools.parallel, parser.call_id)
            reason = finish_reason(reason, message.tool_calls is not None)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=_logprobs(gathered.logprobs, self.k) if self.k is not None else None,
            finish_reason=reason,
            stop_reason=gathered.stop_reason,
            token_ids=self._token_ids(gathered.token_ids),
        )


async def _beam_search(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    http_request: web.Request,
    messages: list[dict[str, Any]],
    max_tokens: int | None,
) -> web.StreamResponse:
    """use_beam_search: the n best beams as n choices, best first."""
    try:  # in a thread: a long conversation must not stall this event loop's other requests
        prompt = truncate_prompt(
            await asyncio.to_thread(
                apply_chat_template,
                ctx.tokenizer,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template or ctx.chat_template,
                chat_template_kwargs=template_kwargs(req.chat_template_kwargs),
                add_special_tokens=req.add_special_tokens,
            ),
            req.truncate_prompt_tokens,
            ctx.max_model_len,
        )
    except ValueError as e:
        raise bad_request(str(e)) from None
    params = beam_search_params(req, max_tokens, [prompt], ctx.max_model_len)
    base_id = request_id("chatcmpl", http_request, req.request_id)
    out = (await run_beam_search(ctx, [prompt], params, base_id, req))[0]
    generated = beam_token_ids([out], [prompt])[0]
    role = _message_role(ctx, req)
    used = usage(len(prompt), sum(map(len, generated)))
    return_ids = bool(req.return_token_ids)
    if not req.stream:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(role=role, content=beam.text),
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
                token_ids=tokens if return_ids else None,
            )
            for i, (beam, tokens) in enumerate(zip(out.sequences, generated))
        ]
        return json_response(
            ChatCompletionResponse(
                id=base_id,
                model=ctx.model_name,
                choices=choices,
                usage=used,
                prompt_token_ids=prompt if return_ids else None,
            )
        )
    created = int(time.time())
    chunks = []
    for i, (beam, tokens) in enumerate(zip(out.sequences, generated)):
        for choice in (
            ChatStreamChoice(index=i, delta=ChatDelta(role=role, content="")),
            ChatStreamChoice(
                index=i,
                delta=ChatDelta(content=beam.text),
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
                token_ids=tokens if return_ids else None,
            ),
        ):
            chunks.append(
                ChatCompletionChunk(
                    id=base_id, created=created, model=ctx.model_name, choices=[choice]
                )
            )
    if return_ids:
        chunks[0].prompt_token_ids = prompt
    if req.stream_options and req.stream_options.include_usage:
        chunks.append(
            ChatCompletionChunk(
                id=base_id, created=created, model=ctx.model_name, choices=[], usage=used
            )
        )
    return await stream_sse(http_request, single_events(chunks))
