"""SamplingParams: how one request samples. A protocol leaf: imports nothing from the project."""

from __future__ import annotations

import math
from typing import Any

import msgspec

# Temperatures below this are treated as greedy, as vLLM does.
SAMPLING_EPS = 1e-5


# The kinds of constraint, in the order vLLM checks them; a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM's structured_outputs: constrain the output to a JSON schema, a regex, one of a list
    of strings, an EBNF (GBNF) grammar, any JSON object, or a structural tag. Exactly one kind
    is set; the options refine json and json_object. The grammar itself is checked where it is
    compiled (engine_core.structured_output.grammar.check_grammar)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # A JSON string (or object): xgrammar's structural tag, or vLLM's legacy
    # {"type": "structural_tag", "structures": [...], "triggers": [...]}.
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                f"{', '.join(kinds) if kinds else 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """vLLM's sampling parameters; invalid values raise ValueError at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words (text) never to complete; whoever tokenizes the request (the tokenizer process, the
    # LLM class) turns them into bad_words_token_ids, the form the engine core applies: the
    # last token of a sequence is banned when the output so far ends with the tokens before it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # A reasoning model's structured_outputs apply to its answer only: the grammar starts after
    # the output first ends with one of these token sequences (the reasoning's end, e.g.
    # [[id of "</think>"]]); None: from the first token. The API server and LLM.chat set it
    # from --reasoning-parser (frontend/reasoning).
    reasoning_end_token_ids: list[list[int]] | None = None
    # Keep only the prompt's last k tokens (-1: as many as the model's context allows);
    # applied where the prompt is tokenized.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.logit_bias is not None and not all(
            math.isfinite(b) for b in self.logit_bias.values()
        ):
            raise ValueError("logit_bias values must be finite numbers")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(
                    f"{name} must be -1 (whole vocabulary) or non-negative, got {value}"
                )
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.bad_words_token_ids is not None and any(not w for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must hold non-empty token id lists")
        if self.reasoning_end_token_ids is not None and (
            not self.reasoning_end_token_ids or any(not s for s in self.reasoning_end_token_ids)
        ):
            raise ValueError("reasoning_end_token_ids must hold non-empty token id lists")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise ValueError(
                "truncate_prompt_tokens must be -1 (the model's context length) or "
                f"at least 1, got {self.truncate_prompt_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < SAMPLING_EPS

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """Token ids that end generation: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids
