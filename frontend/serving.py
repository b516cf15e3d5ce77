"""What completions and chat completions share: the served model, sampling parameters, the
TokenizerClient streams of several prompts, and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from frontend.errors import ApiError, bad_request, error_body
from frontend.openai_protocol import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
    _SamplingFields,
)
from protocol.sampling_params import SamplingParams, StructuredOutputsParams
from protocol.tokenizer import GenerateRequest, RequestDelta, TokenLogprob
from tokenizer_proc.client import TokenizerClient, TokenizerRequestError

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase

    from frontend.reasoning.parser import ReasoningParser
    from frontend.serving_harmony import HarmonyChat

_ENCODER = msgspec.json.Encoder()


@dataclass
class ServingContext:
    """One API server's view of the engine."""

    model_name: str
    max_model_len: int
    vocab_size: int
    client: TokenizerClient
    tokenizer: PreTrainedTokenizerBase
    api_server_index: int = 0
    model_root: str | None = None
    # --response-role: the role of chat answers.
    response_role: str = "assistant"
    # --chat-template (its text), for /tokenize; the tokenizer processes have their own copy.
    chat_template: str | None = None
    # --tool-call-parser when --enable-auto-tool-choice is set: serves tool_choice "auto".
    tool_parser: str | None = None
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in answers.
    enable_prompt_tokens_details: bool = False
    # --served-model-name's names, model_name first: a request's model may be any of them.
    served_model_names: tuple[str, ...] = ()
    # A gpt-oss model's chat format (openai-harmony): chat prompts and answers go through it.
    harmony: HarmonyChat | None = None
    # --reasoning-parser: chat answers' reasoning apart from their content (frontend/reasoning).
    reasoning_parser: ReasoningParser | None = None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.served_model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")


# The most choices one request may ask for (OpenAI's limit): each is a sequence in the engine.
MAX_N = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The id the API server chose for an HTTP request (api_server.prepared).
REQUEST_ID = web.RequestKey("request_id", str)


def request_id(
    prefix: str, http_request: web.Request | None = None, field: str | None = None
) -> str:
    """'<prefix>-<id>' as vLLM builds it: the id the API server chose for the HTTP request (a
    client's X-Request-Id, see api_server.prepared), else the body's request_id field,
    else a random one."""
    base = http_request.get(REQUEST_ID) if http_request is not None else None
    return f"{prefix}-{base or field or uuid.uuid4().hex}"


def sampling_params(
    req: _SamplingFields,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from a request's fields; 400 naming the field on an invalid value."""
    kwargs: dict[str, Any] = dict(
        n=req.n,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else (req.stop or None),
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=structured_outputs,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    if req.logit_bias:
        kwargs["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    for name, value in kwargs.items():  # the IPC encoder takes 64-bit integers only
        values = (
            value
            if isinstance(value, list)
            else list(value)
            if isinstance(value, dict)
            else [value]
        )
        if any(type(v) is int and not _INT64_MIN <= v <= _INT64_MAX for v in values):
            raise bad_request(f"{name} is out of the 64-bit integer range", name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param if param in kwargs else None) from None


async def merged_deltas(
    ctx: ServingContext, requests: list[GenerateRequest]
) -> AsyncGenerator[tuple[int, RequestDelta], None]:
    """(prompt index, delta) of every request, as they come; closing it aborts them all.

    A refusal by the tokenizer process raises ApiError with its status.
    """
    if len(requests) == 1:
        gen = ctx.client.generate(requests[0])
        try:
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    yield 0, delta
        except TokenizerRequestError as e:
            raise ApiError(e.status, str(e)) from None
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: GenerateRequest) -> None:
        gen = ctx.client.generate(request)
        try:
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except TokenizerRequestError as e:
            queue.put_nowait((index, ApiError(e.status, str(e))))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        done = 0
        while done < len(tasks):
            index, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def top_entries(position: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """The top-k candidates of one position, most likely first."""
    ranked = [e for e in position if e.rank is not None and e.rank <= k]
    ranked.sort(key=lambda e: e.rank)
    seen, out = set(), []
    for e in ranked:
        if e.token_id not in seen:
            seen.add(e.token_id)
            out.append(e)
    return out[:k]


def prompt_logprobs_json(positions: list[list[TokenLogprob] | None], k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per position the prompt's own token and the top-k (k = -1: all)."""
    out: PromptLogprobs = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        chosen = position[0]
        entries = {str(chosen.token_id): chosen}
        for e in position[1:] if k == -1 else top_entries(position, k):
            entries.setdefault(str(e.token_id), e)
        out.append(
            {
                key: PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token)
                for key, e in entries.items()
            }
        )
    return out


def widest_logprobs(*ks: int | None) -> int | None:
    """The widest of several logprob counts (-1, the whole vocabulary, is the widest)."""
    given = [k for k in ks if k is not None]
    if not given:
        return None
    return -1 if -1 in given else max(given)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> UsageInfo:
    """OpenAI's usage; prompt_tokens_details when cached_tokens is given (the server's
    --enable-prompt-tokens-details)."""
    details = None if cached_tokens is None else PromptTokenUsageInfo(cached_tokens=cached_tokens)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_ENCODER.encode(obj), content_type="application/json")


async def stream_sse(http_request: web.Request, events: AsyncIterator[Any]) -> web.StreamResponse:
    """Send events as server-sent events, then `data: [DONE]`.

    The first event is awaited before the headers go out, so a request refused at once gets a
    plain HTTP error. A later error is sent as an error event; a client that goes away closes
    events, which aborts the request.
    """
    async with contextlib.aclosing(events):
        first = await anext(events, None)  # ApiError propagates: a normal error response
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http_request)
        try:
            if first is not None:
                await response.write(b"data: " + _ENCODER.encode(first) + b"\n\n")
                async for event in events:
                    await response.write(b"data: " + _ENCODER.encode(event) + b"\n\n")
        except ApiError as e:
            await response.write(b"data: " + _ENCODER.encode(e.body()) + b"\n\n")
        except ConnectionError:  # the client went away; aclosing aborts the request
            return response
        except Exception as e:
            await response.write(b"data: " + _ENCODER.encode(error_body(500, str(e))) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response
