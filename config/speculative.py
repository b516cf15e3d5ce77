"""SpeculativeConfig: vLLM's --speculative-config (JSON), read and checked once.

A proposer guesses the next num_speculative_tokens tokens of each decoding request; the target
model verifies them all in one forward and rejection sampling keeps what the target itself would
have sampled (gpu_worker/spec_decode/). The methods, as vLLM names them:
- ngram: the tokens that followed the longest earlier match of the sequence's last n tokens
  (prompt_lookup_min <= n <= prompt_lookup_max), from the request's own prompt and outputs;
- draft_model: a smaller model sharing the target's tokenizer (`model`), run autoregressively;
- eagle, eagle3: an EAGLE draft head (`model`) over the target's hidden states.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# What the engine reads of vLLM's SpeculativeConfig; any other key is refused by name.
_ACCEPTED = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
    "revision",
)
# vLLM's keys that ask for something this engine does not do, with the reason.
_REFUSED = {
    "disable_by_batch_size": "speculation is never switched off by batch size",
    "quantization": "the draft model is loaded in its checkpoint's own format only",
    "max_model_len": "the draft model serves the target's max_model_len",
    "speculative_token_tree": "drafts are chains, not trees",
    "disable_padded_drafter_batch": "the drafter's batch is not padded",
}
_VLLM_METHOD_ALIASES = {"[ngram]": "ngram", "draft": "draft_model", "eagle-3": "eagle3"}


@dataclass(slots=True)
class SpeculativeConfig:
    """What --speculative-config asks for, resolved: method and limits, the draft's folder."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    # draft_model / eagle / eagle3: the draft's folder or Hub id as given; model_path: resolved.
    model: str | None = None
    model_path: str = ""
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative_config: method {self.method!r} is not one of "
                f"{', '.join(SPEC_METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise ConfigError(
                "speculative_config: num_speculative_tokens must be at least 1, got "
                f"{self.num_speculative_tokens}"
            )
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ConfigError(
                    "speculative_config: ngram needs 1 <= prompt_lookup_min <= "
                    f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                    f"{self.prompt_lookup_max}"
                )
            if self.model is not None:
                raise ConfigError("speculative_config: method ngram takes no model")
        elif not self.model:
            raise ConfigError(f"speculative_config: method {self.method} needs a model")


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """--speculative-config's JSON (or LLM(speculative_config=...)'s dict) read as vLLM reads
    it: method inferred from model when absent (a name with "eagle3" or "eagle" picks those,
    another model is draft_model), ngram's lookup bounds defaulting to each other or to 5."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative_config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    given = dict(value)
    for key in given:
        if key in _REFUSED:
            raise ConfigError(f"speculative_config: {key} is not supported: {_REFUSED[key]}")
        if key not in _ACCEPTED:
            raise ConfigError(
                f"speculative_config: unknown key {key!r}; this engine reads {', '.join(_ACCEPTED)}"
            )
    method = given.get("method")
    model = given.get("model")
    if method is None:
        if model is None:
            raise ConfigError("speculative_config: give a method (ngram, ...) or a draft model")
        low = str(model).lower()
        method = "eagle3" if "eagle3" in low else "eagle" if "eagle" in low else "draft_model"
    method = _VLLM_METHOD_ALIASES.get(method, method)
    if method == "ngram" and model == "[ngram]":
        model = None
    lo, hi = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    if method == "ngram":
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
    elif lo is not None or hi is not None:
        raise ConfigError(f"speculative_config: prompt_lookup_min/max are ngram's, not {method}'s")
    if given.get("num_speculative_tokens") is None:
        raise ConfigError("speculative_config: num_speculative_tokens is required")
    try:
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=int(given["num_speculative_tokens"]),
            prompt_lookup_min=int(lo or 0),
            prompt_lookup_max=int(hi or 0),
            model=None if model is None else str(model),
            revision=given.get("revision"),
            draft_tensor_parallel_size=given.get("draft_tensor_parallel_size"),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"speculative_config: {e}") from None
