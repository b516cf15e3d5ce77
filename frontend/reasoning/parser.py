"""ReasoningParser: what a model family's reasoning looks like, built once per server with the
model's tokenizer (vLLM's ReasoningParser, as text markers and the engine core's end ids)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend.reasoning.stream import Opening, ReasoningStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ReasoningParser:
    """A family's reasoning markers. A subclass names its start and end markers (STARTS, ENDS)
    and says, from a request's chat_template_kwargs, where the output opens (opening) and which
    token sequences end the reasoning for the engine core (end_token_ids)."""

    name = ""
    STARTS: tuple[str, ...] = ()
    ENDS: tuple[str, ...] = ()

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Markers that are special tokens vanish from text decoded with skip_special_tokens:
        # such a model's chat answers keep special tokens (the stop token is never shown).
        special = set(tokenizer.all_special_tokens)
        self.needs_special_tokens = any(m in special for m in (*self.STARTS, *self.ENDS))

    def opening(self, kwargs: dict[str, Any]) -> Opening:
        """Where a request's output starts, given its chat_template_kwargs."""
        raise NotImplementedError

    def end_token_ids(self, kwargs: dict[str, Any]) -> list[list[int]] | None:
        """The token sequences that end the reasoning (the engine core starts structured
        outputs after one), or None when the output opens in the answer."""
        raise NotImplementedError

    def stream(self, kwargs: dict[str, Any]) -> ReasoningStream:
        """A splitter for one choice of a request."""
        return ReasoningStream(self.STARTS, self.ENDS, self.opening(kwargs))


class ThinkTagParser(ReasoningParser):
    """<think>...</think>, each tag one token of the vocabulary (vLLM's
    BaseThinkingReasoningParser); ValueError at start-up when the tokenizer lacks them."""

    STARTS = ("<think>",)
    ENDS = ("</think>",)
    REQUIRED_TOKENS = (*STARTS, *ENDS)

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in self.REQUIRED_TOKENS if tag not in vocab]
        if missing:
            raise ValueError(missing_tokens_message(self.name, missing))
        self._end_ids = [[vocab[tag]] for tag in self.ENDS]

    def end_token_ids(self, kwargs: dict[str, Any]) -> list[list[int]] | None:
        return None if self.opening(kwargs) is Opening.ANSWER else self._end_ids


def missing_tokens_message(name: str, missing: list[str]) -> str:
    """The refusal of a parser whose tokens the model's vocabulary lacks."""
    return (
        f"--reasoning-parser {name} needs the tokens {' and '.join(missing)} in the model's "
        "vocabulary; this tokenizer has none of that name"
    )
