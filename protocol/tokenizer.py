"""Messages between API servers and tokenizer processes. A protocol module: imports only
protocol modules.

Framing is the engine core's (docs/protocol.md): each message is two frames, [type byte,
msgpack payload]; Structs travel array-like in field order with trailing defaults omitted.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from protocol.sampling_params import SamplingParams

# Bumped on any change a peer of the previous version would misread.
TOKENIZER_PROTOCOL_VERSION = 4


class ApiRequestType(enum.IntEnum):
    """First frame of an API server -> tokenizer process message."""

    HELLO = 0
    GENERATE = 1
    ABORT = 2
    HEARTBEAT = 3  # only to a tokenizer process whose READY agreed to heartbeats


class ApiOutputType(enum.IntEnum):
    """First frame of a tokenizer process -> API server message."""

    READY = 0
    DELTAS = 1
    ERROR = 2
    HEARTBEAT = 3  # only to a client whose HELLO asked for heartbeats


class TokenizerHello(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An API server's first message; answered with TokenizerReady, or ERROR on a mismatch."""

    protocol_version: int
    client_name: str = ""
    # The client's pid and host identity (ipc.process.host_identity): a
    # tokenizer process on the same host watches the pid and aborts the requests of a client
    # that died. Appended with defaults: an older peer ignores them, 0 watches nothing.
    pid: int = 0
    host: str = ""
    # Seconds between the client's heartbeats on a quiet link, when it asks to exchange them
    # (tokenizer_proc/heartbeat.py: it cannot watch the tokenizer process's pid). Appended
    # with a default: 0, and every older client, exchanges none.
    heartbeat_s: float = 0.0


class TokenizerReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The tokenizer process's answer to HELLO: which worker it is and what the model allows."""

    protocol_version: int
    worker_index: int
    model_name: str
    max_model_len: int
    vocab_size: int
    # The engine core's KV cache (appended with defaults: a peer that lacks them reads 0).
    num_blocks: int = 0
    block_size: int = 0
    # Seconds between the tokenizer process's heartbeats to this client: non-zero only when
    # the HELLO asked (an older tokenizer process never sends it, nor expects heartbeats).
    heartbeat_s: float = 0.0


class GenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request: exactly one of prompt text, prompt token ids or chat messages."""

    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # OpenAI-style chat messages, rendered with the chat template: chat_template (a Jinja
    # template), else the tokenizer process's --chat-template, else the model's.
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    api_server_index: int = 0
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = 0.0
    # For messages: OpenAI's tools ({"type": "function", "function": {...}}), passed to the
    # template as transformers does, and extra template variables (e.g. enable_thinking).
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Whether tokenizing adds the tokenizer's special tokens (BOS): None means vLLM's default,
    # true for a prompt and false for messages (the chat template writes its own).
    add_special_tokens: bool | None = None
    # Send the prompt's token ids back, on the request's first delta.
    return_prompt_token_ids: bool = False


class AbortRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Stop requests of this API server; unknown and finished ids are ignored (idempotent)."""

    request_ids: list[str]


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One candidate token at one position: its id, log probability, rank and text."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the sampled token first, then the top-k candidates.
PositionLogprobs = list[TokenLogprob]


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step added to one completion of a request."""

    request_id: str
    index: int = 0  # the completion's index, 0..n-1
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[PositionLogprobs] | None = None
    # On the request's first delta only; the first prompt position has none (nil).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" on the completion's last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # On the request's first delta, when GenerateRequest.return_prompt_token_ids asked for them.
    prompt_token_ids: list[int] | None = None
    # On the request's first delta: EngineCoreOutput.prefill_chunks ([Unix time, tokens] each).
    prefill_chunks: list[tuple[float, int]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Heartbeat(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """'Still here', on a link that carried nothing else for a heartbeat interval: an empty
    array."""


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request that failed; it gets no more deltas. status is HTTP-like (400 invalid, 503 down).
    No request_id and 503 after READY: the tokenizer process took this client for dead (it
    fell silent) and aborted its requests."""

    request_id: str
    message: str
    status: int = 400


API_REQUEST_PAYLOADS: dict[ApiRequestType, object] = {  # msgspec type forms
    ApiRequestType.HELLO: TokenizerHello,
    ApiRequestType.GENERATE: GenerateRequest,
    ApiRequestType.ABORT: AbortRequest,
    ApiRequestType.HEARTBEAT: Heartbeat,
}
API_OUTPUT_PAYLOADS: dict[ApiOutputType, object] = {
    ApiOutputType.READY: TokenizerReady,
    ApiOutputType.DELTAS: list[RequestDelta],
    ApiOutputType.ERROR: RequestError,
    ApiOutputType.HEARTBEAT: Heartbeat,
}


def api_request_decoders() -> dict[int, msgspec.msgpack.Decoder]:
    """A typed msgpack decoder per API server -> tokenizer message type."""
    return {t.value: msgspec.msgpack.Decoder(p) for t, p in API_REQUEST_PAYLOADS.items()}


def api_output_decoders() -> dict[int, msgspec.msgpack.Decoder]:
    """A typed msgpack decoder per tokenizer -> API server message type."""
    return {t.value: msgspec.msgpack.Decoder(p) for t, p in API_OUTPUT_PAYLOADS.items()}
