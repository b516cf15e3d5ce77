"""What tokenizing a request involves beyond the prompt itself, as vLLM does it: bad_words turned
into token ids, and truncate_prompt_tokens applied. Shared by the tokenizer process and the
offline LLM class."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol.sampling_params import SamplingParams

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """Each word's token ids as vLLM derives them: the word as written (left-stripped), and,
    when the tokenizer spells it differently after a space in as many tokens, that form too."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def with_bad_words_tokenized(
    tokenizer: PreTrainedTokenizerBase, params: SamplingParams
) -> SamplingParams:
    """params, with bad_words_token_ids derived from bad_words when it has any."""
    if not params.bad_words:
        return params
    return msgspec.structs.replace(
        params, bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words)
    )


def truncate_prompt(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt's last k tokens (truncate_prompt_tokens; -1: max_model_len, None: all of
    them); ValueError when more than the model's context length is asked for, as vLLM refuses
    it."""
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
            f"({max_model_len}). Please, select a smaller truncation size."
        )
    return token_ids[-k:]
