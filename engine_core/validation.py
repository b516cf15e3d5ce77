"""Checks of a request against the model, made before anything is scheduled."""

from __future__ import annotations

from config.engine import EngineConfig
from protocol.engine_core import EngineCoreRequest


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says which field and why."""


def validate_request(req: EngineCoreRequest, config: EngineConfig) -> None:
    """Raise InvalidRequestError when req cannot run on this model and configuration."""
    assert config.arch is not None
    vocab, max_len = config.arch.vocab_size, config.max_model_len
    prompt = req.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("the prompt is empty; it needs at least one token")
    if len(prompt) >= max_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_len} tokens, but the prompt has "
            f"{len(prompt)} tokens, leaving no room for output"
        )
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    if req.priority != 0 and config.scheduler.scheduling_policy != "priority":
        raise InvalidRequestError(
            f"Got priority {req.priority} but Priority scheduling is not "
            "enabled (start the engine with --scheduling-policy priority)"
        )
    params = req.sampling_params
    if params.bad_words and params.bad_words_token_ids is None:
        raise InvalidRequestError(
            "bad_words reached the engine core as text; the engine core "
            "needs them tokenized, as bad_words_token_ids"
        )
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids or ()),
        ("logit_bias", (params.logit_bias or {}).keys()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", (t for w in params.bad_words_token_ids or () for t in w)),
        ("reasoning_end", (t for w in params.reasoning_end_token_ids or () for t in w)),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} token id {bad} is outside the vocabulary [0, {vocab})"
            )
    cap = config.model.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and cap != -1 and (value == -1 or value > cap):
            raise InvalidRequestError(
                f"{name}={value} exceeds the engine's max_logprobs ({cap}); "
                f"start the engine with a larger --max-logprobs to allow it"
            )


def check_completion_fits(req: EngineCoreRequest, config: EngineConfig) -> None:
    """What the OpenAI API (and vLLM's server) refuse: a prompt plus the max_tokens asked for
    that exceed the context length. The offline LLM instead stops such a request at
    max_model_len with finish reason "length", as vLLM's LLM does."""
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is None:
        return
    max_len, prompt = config.max_model_len, len(req.prompt_token_ids)
    if prompt + max_tokens > max_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion."
        )
