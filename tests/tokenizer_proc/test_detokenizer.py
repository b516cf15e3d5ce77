"""Tests for incremental detokenization, stop strings and logprob conversion."""

from __future__ import annotations

import random

import msgspec
import pytest

from protocol.engine_core import Logprobs
from protocol.sampling_params import SamplingParams
from tokenizer_proc import incremental
from tokenizer_proc.detokenizer import IncrementalDetokenizer, convert_logprobs
from tokenizer_proc.request_output import Logprob
from tokenizer_proc.tokenizer import apply_chat_template

MULTILINGUAL = "你好，世界！ Привет, мир! 😀🎉 👨‍👩‍👧 naïve café — done."
CHAT = "Sure.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>"


@pytest.fixture(params=["DecodeStream", "offsets"])
def decoder_kind(request, monkeypatch):
    """Run a test with tokenizers' DecodeStream and with the prefix/read-offset fallback."""
    if request.param == "offsets":
        monkeypatch.setattr(incremental, "DecodeStream", None)
    return request.param


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return apply_chat_template(tokenizer, [{"role": "user", "content": "Say something."}])


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, prompt, token_ids, **params):
    """Feed token_ids one at a time; return the detokenizer, the deltas and the stop string."""
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params))
    deltas, streamed = [], ""
    for i, token_id in enumerate(token_ids):
        stop = detok.update([token_id], finished=i == len(token_ids) - 1)
        deltas.append(detok.get_next_delta())
        streamed += deltas[-1]
        # Streamed text is never retracted.
        assert detok.output_text.startswith(streamed)
        if stop is not None:
            return detok, deltas, stop
    return detok, deltas, None


def test_multilingual_split_bytes_never_yield_replacement_char(tokenizer, prompt, decoder_kind):
    ids = encode(tokenizer, MULTILINGUAL)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "needs characters split in tokens"
    detok, deltas, stop = stream(tokenizer, prompt, ids)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, prompt, decoder_kind, skip):
    ids = encode(tokenizer, CHAT)
    detok, deltas, _ = stream(tokenizer, prompt, ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


def test_multi_token_update_matches_single_steps(tokenizer, prompt):
    ids = encode(tokenizer, MULTILINGUAL)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for i in range(0, len(ids), 3):
        detok.update(ids[i : i + 3], False)
        deltas.append(detok.get_next_delta())
    assert "".join(deltas) == tokenizer.decode(ids)


def test_text_stops_before_stop_string(tokenizer, prompt):
    ids = encode(tokenizer, "The answer is 42. Next question please.")
    detok, deltas, stop = stream(tokenizer, prompt, ids, stop=["Next", "never"])
    assert stop == "Next"
    assert detok.output_text == "".join(deltas) == "The answer is 42. "


def test_include_stop_str_in_output(tokenizer, prompt):
    ids = encode(tokenizer, "The answer is 42. Next question please.")
    detok, deltas, stop = stream(
        tokenizer, prompt, ids, stop=["Next"], include_stop_str_in_output=True
    )
    assert stop == "Next"
    assert detok.output_text == "".join(deltas) == "The answer is 42. Next"


def test_stop_string_spanning_tokens_is_found_on_its_last_token(tokenizer, prompt):
    stop_str = "Привет, мир"
    ids = encode(tokenizer, "Он сказал: Привет, мир! И ушёл.")
    detok, _, stop = stream(tokenizer, prompt, ids, stop=[stop_str])
    assert stop == stop_str
    assert len(encode(tokenizer, stop_str)) > 3
    # Found on the first token whose text completes the stop string, not later.
    assert stop_str not in tokenizer.decode(detok.output_token_ids[:-1])
    assert detok.output_text == "Он сказал: "


@pytest.mark.parametrize("include", [False, True])
def test_text_after_stop_string_in_same_token_is_dropped(tokenizer, prompt, include):
    ids = encode(tokenizer, "Hello world, friends")
    assert tokenizer.decode(ids[1]) == " world"
    detok, deltas, stop = stream(
        tokenizer, prompt, ids, stop=["wor"], include_stop_str_in_output=include
    )
    assert stop == "wor"
    assert detok.output_text == "".join(deltas) == ("Hello wor" if include else "Hello ")


def test_earliest_stop_string_wins(tokenizer, prompt):
    # All three complete on the token " three"; the one starting first truncates the most.
    ids = encode(tokenizer, "one two three")
    detok, _, stop = stream(tokenizer, prompt, ids, stop=["three", "o t", "two three"])
    assert stop == "two three"
    assert detok.output_text == "one "


def test_partial_stop_string_is_held_back_then_released(tokenizer, prompt):
    ids = encode(tokenizer, "a <EN then <END> b")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["<END>"]))
    streamed, stop = "", None
    for token_id in ids:
        stop = detok.update([token_id], False)
        streamed += detok.get_next_delta()
        if detok.output_text.endswith("<EN"):
            assert not streamed.endswith("<EN") and "<" not in streamed
        if stop is not None:
            break
    assert stop == "<END>"
    assert "<EN then" in streamed
    assert streamed + detok.get_next_delta() == detok.output_text == "a <EN then "


def test_partial_stop_string_is_flushed_on_finish(tokenizer, prompt):
    ids = encode(tokenizer, "almost <EN")
    detok, deltas, stop = stream(tokenizer, prompt, ids, stop=["<END>"])
    assert stop is None
    assert "".join(deltas) == detok.output_text == "almost <EN"


def test_stop_strings_ignored_within_min_tokens(tokenizer, prompt):
    ids = encode(tokenizer, "stop here, then stop there")
    detok, _, stop = stream(tokenizer, prompt, ids, stop=["stop"], min_tokens=2, max_tokens=16)
    assert stop == "stop"
    assert detok.output_text == "stop here, then "


def test_update_after_stop_is_ignored(tokenizer, prompt):
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["x"]))
    assert detok.update(encode(tokenizer, "a x b"), False) == "x"
    assert detok.update(encode(tokenizer, " more"), False) is None
    assert detok.get_next_delta() == detok.output_text == "a "


def test_random_stop_strings_match_reference(tokenizer, prompt):
    rng = random.Random(0)
    words = ["alpha", " beta", "гамма", " 😀", "δ", ",", " 世界", "\n", " end", "ing"]
    for _ in range(40):
        text = "".join(rng.choices(words, k=12))
        start = rng.randrange(len(text) - 1)
        stop_str = text[start : start + rng.randint(1, 6)]
        include = rng.random() < 0.5
        ids = encode(tokenizer, text)
        detok, deltas, stop = stream(
            tokenizer, prompt, ids, stop=[stop_str], include_stop_str_in_output=include
        )
        full = tokenizer.decode(ids)
        at = full.find(stop_str)
        assert stop == stop_str
        assert detok.output_text == "".join(deltas) == full[: at + len(stop_str) if include else at]


def test_convert_logprobs(tokenizer):
    hello, world, im_end = encode(tokenizer, "Hello world<|im_end|>")
    lp = Logprobs(
        token_ids=[[hello, hello, world], [im_end, world, hello]],
        logprobs=[[-0.1, -0.1, -2.5], [-3.0, -0.5, -1.0]],
        ranks=[1, 7],
    )
    first, second = convert_logprobs(tokenizer, lp)
    assert first == {hello: Logprob(-0.1, 1, "Hello"), world: Logprob(-2.5, 2, " world")}
    assert second == {
        im_end: Logprob(-3.0, 7, "<|im_end|>"),
        world: Logprob(-0.5, 1, " world"),
        hello: Logprob(-1.0, 2, "Hello"),
    }
    assert list(second) == [im_end, world, hello]
    logprob = msgspec.msgpack.decode(msgspec.msgpack.encode(second[im_end]), type=Logprob)
    assert (logprob.logprob, logprob.rank, logprob.decoded_token) == (-3.0, 7, "<|im_end|>")
