"""Messages the engine core sends and receives. A protocol module: imports only protocol modules."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from protocol.frames import FloatMatrix, FrameDecoder, IntMatrix, IntVector
from protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; str() gives the OpenAI / vLLM name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request for the engine core."""

    request_id: str
    # A list, or an int array (the Python clients send long prompts so, as an extra frame);
    # the engine core process turns an array into a list before anything else sees it.
    prompt_token_ids: IntVector
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0


# The wire form of protocol.step.LogprobsLists (same fields): the engine core process sends large
# ones as arrays in extra frames, so a client decodes lists or read-only numpy arrays.
class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Per position: [sampled, top-1, ..., top-K] ids and logprobs, and the sampled token's rank."""

    token_ids: IntMatrix
    logprobs: FloatMatrix
    ranks: IntVector


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (None for EOS, length and abort).
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # On a request's first output: [Unix time, tokens] of each prompt chunk as it was scheduled
    # (the first one ends the request's wait in the queue; several: chunked prefill).
    prefill_chunks: list[tuple[float, int]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding's counts of one step, as vLLM counts them: a request verifying
    drafts is one draft; num_accepted_tokens_per_pos[j] counts the drafts whose j-th token
    was accepted (a draft's accepted tokens are a prefix of it)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Counters of one engine step, for metrics and logs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    # Every prompt token of the requests that produced their first token in this step, cached or
    # not (vLLM's prompt_tokens); of those, the ones the prefix cache served.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # Set in steps that verified drafts (speculative decoding).
    spec_decoding: SpecDecodingStats | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one step for one client."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


# ---- The wire protocol of the engine core process (docs/protocol.md) ----

# Bumped on any change a peer of the previous version would misread.
PROTOCOL_VERSION = 6


class RequestType(enum.IntEnum):
    """First frame (one byte) of a client -> engine core message; payload and buffers follow."""

    HELLO = 0
    ADD = 1
    ABORT = 2
    UTILITY = 3


class OutputType(enum.IntEnum):
    """First frame (one byte) of an engine core -> client message; payload and buffers follow."""

    READY = 0
    OUTPUTS = 1
    UTILITY = 2
    ERROR = 3
    DEAD = 4


class ClientHello(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A client's first message; answered with EngineCoreReady, or ERROR on a version mismatch."""

    protocol_version: int
    client_name: str = ""


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine core's answer to HELLO: what a client needs to know about the loaded model."""

    protocol_version: int
    model_name: str
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int] = []


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Call a named engine core method between steps; call_id pairs the call with its output."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The result of a utility call, or the error that stopped it."""

    call_id: int
    result: Any = None
    error: str | None = None


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the engine core refused; request_id is "" when the frame named none."""

    request_id: str
    message: str


class EngineDead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sent to every known client just before the engine core exits on a fatal error."""

    message: str


# The payload type of each message type, for typed decoders on either side.
REQUEST_PAYLOADS: dict[RequestType, object] = {  # msgspec type forms
    RequestType.HELLO: ClientHello,
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: list[str],
    RequestType.UTILITY: UtilityRequest,
}
OUTPUT_PAYLOADS: dict[OutputType, object] = {
    OutputType.READY: EngineCoreReady,
    OutputType.OUTPUTS: EngineCoreOutputs,
    OutputType.UTILITY: UtilityOutput,
    OutputType.ERROR: RequestError,
    OutputType.DEAD: EngineDead,
}


def request_decoders() -> dict[int, FrameDecoder]:
    """A typed decoder per request type (one set per thread)."""
    return {t.value: FrameDecoder(p) for t, p in REQUEST_PAYLOADS.items()}


def output_decoders() -> dict[int, FrameDecoder]:
    """A typed decoder per output type (one set per thread)."""
    return {t.value: FrameDecoder(p) for t, p in OUTPUT_PAYLOADS.items()}
