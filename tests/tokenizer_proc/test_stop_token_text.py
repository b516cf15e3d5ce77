"""The stop token that ends a request (EOS or a stop_token_id) leaves no text, as in vLLM,
unless include_stop_str_in_output; even with skip_special_tokens=False."""

from __future__ import annotations

import pytest

from config.default_model import resolve_model_path
from protocol.sampling_params import SamplingParams
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.mark.parametrize(
    "skip_special, include, expected",
    [
        (False, False, "Hello world"),
        (True, False, "Hello world"),
        (False, True, "Hello world<|im_end|>"),
        (True, True, "Hello world"),
    ],
)
def test_eos_text(tokenizer, skip_special, include, expected):
    params = SamplingParams(skip_special_tokens=skip_special, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), params)
    words = tokenizer.encode("Hello world")
    detok.update(words[:1], False)
    detok.update(
        words[1:] + [tokenizer.convert_tokens_to_ids("<|im_end|>")], True, stop_terminated=True
    )
    assert detok.output_text == expected
    assert len(detok.output_token_ids) == len(words) + 1  # the token itself is still counted


def test_a_stop_token_id_leaves_no_text(tokenizer):
    words = tokenizer.encode("one two three")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop_token_ids=[words[-1]]))
    detok.update(words, True, stop_terminated=True)
    assert detok.output_text == tokenizer.decode(words[:-1])


def test_length_finish_keeps_the_last_token(tokenizer):
    words = tokenizer.encode("one two three")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    detok.update(words, True)
    assert detok.output_text == "one two three"
