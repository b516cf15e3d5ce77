"""The step contract between the engine core's scheduler and the workers.

A protocol module: it imports only other protocol modules, so any process may import it.
A step carries only what changed: new requests in full, running requests' new blocks.
"""

from __future__ import annotations

import msgspec

from protocol.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen (or one resumed after preemption, with its outputs)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    # LongRoPE: the request turns with the long factors (its tokens exceed the original
    # context; the engine core resends a request that crosses it, recomputed from scratch).
    rope_long: bool = False


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Running requests the workers already hold: blocks added this step, tokens computed so far.

    The model runner advances its own computed counts on the device (every scheduled token is
    computed); num_computed_tokens is the scheduler's view, for runners that keep no state.
    """

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    # Structured outputs: the constrained requests that sample this step, and their rows of
    # the token bitmask: little-endian int32, ceil(vocab_size / 32) words per row, bit b of
    # word w allowing token 32 * w + b. The runner applies it to their logits before sampling.
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # Speculative decoding: the draft tokens each request verifies this step (its
    # num_scheduled_tokens count them: 1 + len(drafts) for a decode). The runner computes them
    # after the request's known tokens and samples at each of their positions and one more.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Per sampled position: [sampled, top-1, ..., top-K] ids and logprobs, and the sampled rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced, in the order of req_ids.

    sampled_token_ids[i] is empty for a request in the middle of its prompt, one token for a
    request that sampled, more with speculative decoding. logprobs[i] is
    set when the request asked for logprobs and sampled. prompt_logprobs maps a request to the
    logprobs of its prompt tokens 1..n-1, sent once when its prompt is complete.
    """

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[LogprobsLists | None] = []
    prompt_logprobs: dict[str, LogprobsLists] = {}
    # Speculative decoding: sampled_token_ids[i] holds a request's accepted drafts and the
    # token after them (1 to 1 + drafts), and spec_token_ids[i] the drafts proposed for its
    # next step (empty: none); absent when no request was given any.
    spec_token_ids: list[list[int]] = []
