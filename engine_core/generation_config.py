"""The generation config's request defaults at work: checked against SamplingParams once the
configuration resolves, and the max_new_tokens cap applied to requests that set no max_tokens.
Reading them is config/generation_config.py's job."""

from __future__ import annotations

import msgspec

from config.engine import EngineConfig
from config.errors import ConfigError
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams


def check_sampling_defaults(config: EngineConfig) -> None:
    """ConfigError when the generation config's defaults are not valid sampling parameters."""
    defaults = config.sampling_defaults
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"generation config defaults {defaults}: {e}") from None


def cap_unset_max_tokens(request: EngineCoreRequest, config: EngineConfig) -> EngineCoreRequest:
    """A request without max_tokens (a chat's rest of the context) capped at the generation
    config's max_new_tokens, as vLLM takes the smaller of the two; others as they are."""
    params = request.sampling_params
    if params.max_tokens is not None:
        return request
    cap = config.sampling_defaults.get("max_tokens")
    if cap is None:
        return request
    room = config.max_model_len - len(request.prompt_token_ids)
    return msgspec.structs.replace(
        request, sampling_params=msgspec.structs.replace(params, max_tokens=min(cap, room))
    )
