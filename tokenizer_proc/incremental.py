"""Incremental decoders: one token id in, the newly completed text out, never half a character."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from tokenizers import Tokenizer

if TYPE_CHECKING:  # only a type here: transformers costs a process seconds to import
    from transformers import PreTrainedTokenizerBase

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_REPLACEMENT_CHAR = "\ufffd"
# DecodeStream raises this when a later token rewrites text it has already returned.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"
# Prompt tokens decoded ahead of the output, so the first output token is decoded in context.
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24


class IncrementalDecoder(Protocol):
    """Decodes a request's output one token at a time."""

    def step(self, token_id: int) -> str:
        """Append token_id; return the text it completes ("" while a character is incomplete)."""
        ...


def make_incremental_decoder(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
) -> IncrementalDecoder:
    """Return DecodeStream-based decoding for fast tokenizers, else prefix/read-offset decoding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is not None and backend is not None:
        return StreamDecoder(backend, prompt_token_ids, skip_special_tokens)
    return OffsetDecoder(tokenizer, prompt_token_ids, skip_special_tokens)


class StreamDecoder:
    """tokenizers' DecodeStream, primed with a clean tail of the prompt."""

    def __init__(
        self, backend: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        for token_id in _prompt_context(decode, prompt_token_ids):
            self._step(token_id)

    def step(self, token_id: int) -> str:
        """Append token_id; return the text it completes."""
        return self._step(token_id) or ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_ERR):
                raise
            # Some tokenizers decode non-monotonically, which corrupts the stream; start afresh.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)


class OffsetDecoder:
    """vLLM's prefix/read-offset method: re-decode a short window, emit what it adds when whole."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
    ) -> None:
        self._decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self._ids = _prompt_context(self._decode, prompt_token_ids)
        self._read_offset = len(self._ids)

    def step(self, token_id: int) -> str:
        """Append token_id; return the text it completes."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        # Keep only the tokens since the last read as the next window's prefix.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return text[len(prefix) :]


def _prompt_context(decode: Callable[[list[int]], str], prompt_token_ids: list[int]) -> list[int]:
    """Return the prompt's shortest tail of a few or more tokens decoding to whole characters."""
    n = len(prompt_token_ids)
    for length in range(min(_MIN_PROMPT_CONTEXT, n), min(n, _MAX_PROMPT_CONTEXT) + 1):
        tail = list(prompt_token_ids[n - length :])
        if _REPLACEMENT_CHAR not in decode(tail):
            return tail
    return []
