"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests forbid unknown fields: a field this server does not implement is refused with 400
naming it, never ignored. Fields OpenAI defines but this server does not support (best_of > 1,
prediction, ...) are declared so that the refusal can say why (see check_unsupported); fields
that only annotate a request (metadata, store, user, service_tier) are accepted and ignored, as
vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from frontend.errors import bad_request
from protocol.sampling_params import StructuredOutputsParams


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Response(msgspec.Struct, kw_only=True):
    pass


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request, kw_only=True, omit_defaults=True):
    """response_format.json_schema as OpenAI sends it (strict is always honoured)."""

    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Request, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(_Request, tag_field="type", tag="json_object"):
    pass


class JsonSchemaResponseFormat(_Request, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


class StructuralTagItem(_Request, kw_only=True, omit_defaults=True):
    begin: str
    schema: dict[str, Any] | None = None
    end: str


class StructuralTagFormat(_Request, tag_field="type", tag="structural_tag", omit_defaults=True):
    """vLLM's structural tag: the legacy structures + triggers, or xgrammar's format."""

    structures: list[StructuralTagItem] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat | StructuralTagFormat


class StructuredOutputsRequest(StructuredOutputsParams, forbid_unknown_fields=True):
    """vLLM's structured_outputs request field: StructuredOutputsParams' fields. It may set no
    kind of constraint when response_format or tool_choice sets one (frontend.response_format
    checks the merged whole)."""

    def __post_init__(self) -> None:
        pass


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
    # Annotations only, on every endpoint: accepted and ignored, as vLLM does.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra field: log probabilities of the prompt tokens (-1: the whole vocabulary).
    prompt_logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's extras: only these token ids may be sampled; words never to complete; keep the
    # prompt's last k tokens (-1: as many as fit); the request's id (else a random one);
    # answer with the prompt's and each choice's token ids.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    # Beam search (vLLM's): n beams, scored by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Declared only to be refused with a reason.
    best_of: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    # vLLM's default for a prompt: the tokenizer adds its special tokens (BOS).
    add_special_tokens: bool = True


class TextPart(_Request, kw_only=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None


class FunctionCallParam(_Request, kw_only=True):
    name: str
    # A JSON string, as OpenAI sends it (an object is taken too, as vLLM does).
    arguments: str | dict[str, Any]


class ToolCallParam(_Request, kw_only=True):
    """A call an earlier assistant message made."""

    id: str
    type: str = "function"
    function: FunctionCallParam


class ChatMessage(_Request, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as vLLM takes it (reasoning_content: its older name).
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request, kw_only=True, omit_defaults=True):
    """A function the model may call: {"type": "function", "function": {...}}."""

    type: str
    function: FunctionDefinition


class NamedFunction(_Request, kw_only=True):
    name: str


class NamedToolChoice(_Request, kw_only=True):
    """tool_choice naming the function the model must call."""

    type: str
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A Jinja template for this request instead of the server's (--chat-template) or model's.
    chat_template: str | None = None
    # Extra variables for the template, e.g. Qwen3's {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # "low", "medium" or "high": gpt-oss's system message; another model's template gets it
    # as a variable. include_reasoning false drops the reasoning from the answer.
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    # vLLM's default for chat: the template writes the special tokens itself.
    add_special_tokens: bool = False
    # Declared only to be refused with a reason.
    functions: Any = None
    function_call: Any = None
    prediction: Any = None


class TokenizeRequest(_Request, kw_only=True):
    """POST /tokenize: either prompt or messages (rendered as chat completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request, kw_only=True):
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None


# ---- responses ----


class PromptTokenUsageInfo(_Response, kw_only=True):
    cached_tokens: int | None = None


class UsageInfo(_Response, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details: how many prompt tokens the prefix cache served.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


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
    # With return_token_ids: the prompt's (on a stream's first chunk) and this choice's ids.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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


class FunctionCall(_Response, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's reasoning apart from its answer (gpt-oss's analysis channel), under
    # vLLM's name and its older one, as vLLM answers both.
    reasoning: str | None = None
    reasoning_content: str | None = None


class DeltaFunctionCall(_Response, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response, kw_only=True, omit_defaults=True):
    """A streamed piece of a call: index, id, type and name first, then arguments pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Response, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # and reasoning_content, the same text (vLLM sends both)
    reasoning_content: str | None = None


class ChatChoice(_Response, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatStreamChoice(_Response, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionChunk(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


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
        raise bad_request(
            "best_of is not supported (only best_of=1 or unset), as in vLLM V1", "best_of"
        )
    if req.use_beam_search:
        for name in (
            "logprobs",
            "prompt_logprobs",
            "response_format",
            "structured_outputs",
            "allowed_token_ids",
            "bad_words",
            "logit_bias",
        ):
            if getattr(req, name, None) not in (None, False):
                raise bad_request(f"{name} is not supported with use_beam_search", name)
        if isinstance(req, CompletionRequest) and req.echo:
            raise bad_request("echo is not supported with use_beam_search", "echo")
        if isinstance(req, ChatCompletionRequest) and req.tools:
            raise bad_request("tools are not supported with use_beam_search", "tools")
    if req.logit_bias:
        for key, value in req.logit_bias.items():
            try:
                int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            if not -100.0 <= value <= 100.0:
                raise bad_request(
                    f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                    "logit_bias",
                )
    if req.prompt_logprobs is not None:
        if req.stream:  # vLLM's rule and wording
            raise bad_request(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if req.prompt_logprobs < -1:
            raise bad_request(
                f"prompt_logprobs must be -1 (the whole vocabulary) or at least "
                f"0, got {req.prompt_logprobs}",
                "prompt_logprobs",
            )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        for name in ("functions", "function_call"):
            if getattr(req, name) is not None:
                raise bad_request(
                    f"{name} is deprecated and not supported; use tools and tool_choice", name
                )
        if req.prediction is not None:
            raise bad_request("prediction (predicted outputs) is not supported", "prediction")
    if isinstance(req, CompletionRequest) and req.suffix is not None:
        raise bad_request(
            "suffix is not supported: the model has no fill-in-the-middle tokens", "suffix"
        )


REQUEST_STRUCTS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
RESPONSE_STRUCTS = [
    CompletionResponse,
    ChatCompletionResponse,
    ChatCompletionChunk,
    ModelList,
    TokenizeResponse,
    DetokenizeResponse,
    VersionResponse,
    ErrorResponse,
]
