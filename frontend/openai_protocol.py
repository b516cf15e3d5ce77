"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests forbid unknown fields: a field this server does not implement is refused with 400
naming it, never ignored. Fields OpenAI defines but this server does not support (tools,
best_of > 1, ...) are declared so that the refusal can say why (see check_unsupported).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from frontend.errors import bad_request


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Response(msgspec.Struct, kw_only=True):
    pass


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class ResponseFormat(_Request, kw_only=True):
    type: str
    json_schema: Any = None


class _SamplingFields(_Request, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra field: log probabilities of the prompt tokens (-1: the whole vocabulary).
    prompt_logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    # Declared only to be refused with a reason.
    best_of: int | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Request, kw_only=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None


class ChatMessage(_Request, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Declared only to be refused with a reason.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


class TokenizeRequest(_Request, kw_only=True):
    """POST /tokenize: either prompt or messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request, kw_only=True):
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None


# ---- responses ----


class UsageInfo(_Response, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response, kw_only=True):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(_Response, kw_only=True):
    """One candidate at one prompt position, as vLLM answers prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (None for the first): token id (as a string) -> its candidate.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(_Response, kw_only=True):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(_Response, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChatDelta(_Response, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(_Response, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(_Response, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionChunk(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "engine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []


class TokenizeResponse(_Response, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response, kw_only=True):
    prompt: str


class VersionResponse(_Response, kw_only=True):
    version: str


class ErrorInfo(_Response, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response, kw_only=True):
    error: ErrorInfo


# ---- checks ----


def check_unsupported(req: _SamplingFields) -> None:
    """Refuse, with 400 naming the field, what is declared but not supported."""
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("best_of is not supported (only best_of=1 or unset)", "best_of")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format type {req.response_format.type!r} is not supported "
                          "(only 'text')", "response_format")
    if req.logit_bias:
        for key, value in req.logit_bias.items():
            try:
                int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                  "logit_bias") from None
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for "
                                  f"token {key}", "logit_bias")
    if req.prompt_logprobs is not None:
        if req.stream:  # vLLM's rule and wording
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                              "prompt_logprobs")
        if req.prompt_logprobs < -1:
            raise bad_request(f"prompt_logprobs must be -1 (the whole vocabulary) or at least "
                              f"0, got {req.prompt_logprobs}", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        for name in ("tools", "functions", "function_call", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                raise bad_request(f"{name} is not supported: this server has no tool calling",
                                  name)
        if req.tool_choice is not None and req.tool_choice != "none":
            raise bad_request("tool_choice is not supported: this server has no tool calling",
                              "tool_choice")
    if isinstance(req, CompletionRequest) and req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")


REQUEST_STRUCTS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
RESPONSE_STRUCTS = [CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelList,
                    TokenizeResponse, DetokenizeResponse, VersionResponse, ErrorResponse]
