"""Request preprocessing the tokenizer process does as vLLM's frontend does: bad_words to token
ids, truncate_prompt_tokens, and add_special_tokens for prompts and chat messages."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest
from tokenizer_proc.prompt_inputs import (
    bad_words_token_ids,
    truncate_prompt,
    with_bad_words_tokenized,
)
from tokenizer_proc.tokenizer_proc import TokenizerProc


@functools.cache
def tokenizer(bos: bool = False):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    if bos:  # a tokenizer that adds BOS, as Llama's do
        tok._tokenizer.post_processor = TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
        )
    return tok


def test_bad_words_take_both_spellings_as_vllm_does():
    tok = tokenizer()
    cat, space_cat = tok.encode("cat"), tok.encode(" cat")
    assert bad_words_token_ids(tok, ["cat"]) == [cat, space_cat]
    # The spaced form of a word is kept only when it has as many tokens as the plain one.
    word = " decomposed"
    plain = tok.encode(word.lstrip())
    assert len(plain) != len(tok.encode(word))
    assert bad_words_token_ids(tok, [word]) == [plain]
    params = with_bad_words_tokenized(tok, SamplingParams(bad_words=["cat", word]))
    assert params.bad_words_token_ids == [cat, space_cat, plain]
    assert with_bad_words_tokenized(tok, SamplingParams()).bad_words_token_ids is None


def test_truncate_prompt_keeps_the_last_tokens():
    assert truncate_prompt([1, 2, 3, 4], 2, 10) == [3, 4]
    assert truncate_prompt([1, 2, 3, 4], None, 10) == [1, 2, 3, 4]
    assert truncate_prompt(list(range(20)), -1, 8) == list(range(12, 20))
    with pytest.raises(ValueError, match="greater than max_model_len"):
        truncate_prompt([1], 11, 10)


@pytest.mark.parametrize("flag, expect_bos", [(None, True), (True, True), (False, False)])
def test_add_special_tokens_for_a_prompt(flag, expect_bos):
    proc = SimpleNamespace(tokenizer=tokenizer(bos=True), chat_template=None)
    ids = TokenizerProc._prompt_token_ids(
        proc, GenerateRequest("r", SamplingParams(), prompt="Hello world", add_special_tokens=flag)
    )
    assert (ids[0] == 1) == expect_bos and ids[-2:] == tokenizer().encode("Hello world")


@pytest.mark.parametrize("flag, bos_count", [(None, 0), (False, 0), (True, 1)])
def test_add_special_tokens_for_messages(flag, bos_count):
    proc = SimpleNamespace(tokenizer=tokenizer(bos=True), chat_template=None)
    plain = TokenizerProc._prompt_token_ids(
        SimpleNamespace(tokenizer=tokenizer(), chat_template=None),
        GenerateRequest("r", SamplingParams(), messages=[{"role": "user", "content": "hi"}]),
    )
    ids = TokenizerProc._prompt_token_ids(
        proc,
        GenerateRequest(
            "r",
            SamplingParams(),
            messages=[{"role": "user", "content": "hi"}],
            add_special_tokens=flag,
        ),
    )
    assert len(ids) - len(plain) == bos_count and ids[-len(plain) :] == plain
