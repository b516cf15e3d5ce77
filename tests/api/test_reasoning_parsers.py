"""The reasoning parsers (frontend/reasoning) fed real chat templates' output: Qwen3's and
DeepSeek-R1's templates (tests/fixtures/chat_templates) rendered by transformers, the model's
turn cut out of the rendering; each output split whole and streamed at every split point (a tag
over two deltas), which must give the same reasoning and content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend.reasoning.chat import ChatReasoning
from frontend.reasoning.registry import reasoning_parser
from frontend.reasoning.stream import split_reasoning
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
R1 = (TEMPLATES / "deepseek_r1_distill_qwen.jinja").read_text()
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.add_tokens(["<think>", "</think>"])  # added tokens, not special, as in Qwen3's
    return tok


def _render(tok, template, messages, **kwargs):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def _streamed(parser, kwargs, pieces):
    stream = parser.stream(kwargs)
    reasoning, content = "", ""
    for k, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=k == len(pieces) - 1)
        reasoning += r
        content += c
    return reasoning or None, content or None


def _every_split(parser, kwargs, text, expected):
    """Whole, then in two pieces at every point, then three around each tag, then char by char."""
    assert split_reasoning(parser.stream(kwargs), text) == expected
    for i in range(len(text) + 1):
        assert _streamed(parser, kwargs, [text[:i], text[i:]]) == expected, i
    for i in range(len(text) + 1):
        for j in range(i, min(len(text), i + 12) + 1):
            assert _streamed(parser, kwargs, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(parser, kwargs, list(text)) == expected


def _model_turn(tok, template, reasoning, answer, **kwargs):
    """What the model writes for its turn: the rendering of an assistant message that carries
    reasoning_content, less the prompt before it and the end-of-turn after it."""
    prompt = _render(tok, template, ASK, add_generation_prompt=True, **kwargs)
    turn = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    full = _render(tok, template, [*ASK, turn], **kwargs)
    assert full.startswith(prompt)
    return full[len(prompt) :].removesuffix("<|im_end|>\n")


def test_qwen3_thinking_output_splits_at_every_point(tokenizer):
    parser = reasoning_parser("qwen3", tokenizer)
    out = _model_turn(tokenizer, QWEN3, "2 plus 3 is 5.", "The answer is 5.")
    assert out == "<think>\n2 plus 3 is 5.\n</think>\n\nThe answer is 5."
    _every_split(parser, {}, out, ("\n2 plus 3 is 5.\n", "\n\nThe answer is 5."))
    # enable_thinking true is the default.
    assert split_reasoning(parser.stream({"enable_thinking": True}), out)[1] == (
        "\n\nThe answer is 5."
    )


def test_qwen3_without_thinking_is_all_content(tokenizer):
    parser = reasoning_parser("qwen3", tokenizer)
    off = {"enable_thinking": False}
    prompt = _render(tokenizer, QWEN3, ASK, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # closed in the prompt
    _every_split(parser, off, "The answer is 5.", (None, "The answer is 5."))
    # The engine core constrains such an answer from its first token.
    assert parser.end_token_ids(off) is None
    assert parser.end_token_ids({}) == [[tokenizer.convert_tokens_to_ids("</think>")]]


def test_deepseek_r1_output_starts_inside_the_reasoning(tokenizer):
    parser = reasoning_parser("deepseek_r1", tokenizer)
    prompt = _render(tokenizer, R1, ASK, add_generation_prompt=True)
    assert prompt.endswith("<｜Assistant｜><think>\n")  # the template opens the reasoning
    out = "Okay, 2 + 3.\nThat is 5.\n</think>\n\nThe answer is **5**."
    _every_split(parser, {}, out, ("Okay, 2 + 3.\nThat is 5.\n", "\n\nThe answer is **5**."))
    # The history the template renders back keeps the answer only.
    turn = {"role": "assistant", "content": out}
    assert _render(tokenizer, R1, [*ASK, turn]).endswith(
        "<｜Assistant｜>\n\nThe answer is **5**.<｜end▁of▁sentence｜>"
    )
    # Cut by max_tokens inside the reasoning: all of it is reasoning.
    _every_split(parser, {}, "Okay, 2 + 3.\nThat </th", ("Okay, 2 + 3.\nThat </th", None))
    # A <think> the model writes itself is dropped.
    _every_split(parser, {}, "<think>\nhm</think>5", ("\nhm", "5"))


def test_granite_phrases(tokenizer):
    parser = reasoning_parser("granite", tokenizer)
    out = "Here is my thought process:\nAdd them.\nHere is my response:\n2 + 3 = 5."
    _every_split(parser, {}, out, ("\nAdd them.\n", "\n2 + 3 = 5."))
    alt = "Here's my thought process: add. Here's my response: 5"
    _every_split(parser, {}, alt, (" add. ", " 5"))
    _every_split(parser, {}, "Here is 5.", (None, "Here is 5."))  # no reasoning
    # The engine core's end ids: the response phrase's tokens as the model writes them.
    ends = parser.end_token_ids({"thinking": True})
    assert ends and parser.end_token_ids({}) is None
    ids = tokenizer.encode(out, add_special_tokens=False)
    assert any(ids[i : i + len(e)] == e for e in ends for i in range(len(ids))), (
        "the response phrase's tokens are not in the output's"
    )


def test_include_reasoning_false_and_structured_outputs(tokenizer):
    parser = reasoning_parser("qwen3", tokenizer)
    chat = ChatReasoning(parser, None, include_reasoning=False)
    message = chat.message("assistant", "<think>x</think>y")
    assert message.reasoning is None and message.content == "y"
    head, content = chat.stream_delta(0, "<think>x</think>y", finished=True)
    assert head is None and content == "y"
    shown = ChatReasoning(parser, None).message("assistant", "<think>x</think>")
    assert shown.reasoning == shown.reasoning_content == "x" and shown.content is None
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    ChatReasoning(parser, {"enable_thinking": True}).prepare_params(params)
    assert params.reasoning_end_token_ids == [[tokenizer.convert_tokens_to_ids("</think>")]]
    free = SamplingParams()
    ChatReasoning(parser, None).prepare_params(free)
    assert free.reasoning_end_token_ids is None


def test_unknown_names_and_missing_tags_are_refused(tokenizer):
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path

    with pytest.raises(ValueError, match="unknown --reasoning-parser"):
        reasoning_parser("nope", tokenizer)
    plain = AutoTokenizer.from_pretrained(resolve_model_path(None))
    with pytest.raises(ValueError, match="needs the tokens <think> and </think>"):
        reasoning_parser("deepseek_r1", plain)
    assert reasoning_parser("openai_gptoss", tokenizer) is None  # harmony reads gpt-oss's


def test_launch_checks_the_tokenizer_files(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path
    from frontend.reasoning.registry import check_tokenizer_files

    tokenizer.save_pretrained(tmp_path / "tags")
    check_tokenizer_files("qwen3", str(tmp_path / "tags"))
    AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="qwen3 needs the tokens <think> and </think>"):
        check_tokenizer_files("qwen3", str(tmp_path / "plain"))
    check_tokenizer_files("granite", str(tmp_path / "plain"))  # phrases, no tokens needed
    check_tokenizer_files(None, str(tmp_path / "plain"))
    # A Unigram tokenizer.json lists its vocabulary as [token, score] pairs.
    unigram = tmp_path / "unigram"
    unigram.mkdir()
    model = {"type": "Unigram", "vocab": [["<unk>", 0.0], ["<think>", -1.0], ["a", -2.0]]}
    (unigram / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": []}))
    with pytest.raises(ValueError, match="</think>"):
        check_tokenizer_files("qwen3", str(unigram))
    (unigram / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        check_tokenizer_files("qwen3", str(unigram))


def test_special_tags_keep_special_tokens_in_the_text():
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    parser = reasoning_parser("qwen3", tok)
    ids = tok.encode("<think>x</think>y", add_special_tokens=False)
    assert "</think>" not in tok.decode(ids, skip_special_tokens=True)  # why it matters
    params = SamplingParams()
    ChatReasoning(parser, None).prepare_params(params)
    assert params.skip_special_tokens is False
    assert ChatReasoning(parser, None).message("assistant", tok.decode(ids)).content == "y"
