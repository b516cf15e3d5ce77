"""Tests for loading the tokenizer and applying the chat template."""

from __future__ import annotations

import pytest

from tokenizer_proc.tokenizer import apply_chat_template

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"


def test_load_tokenizer_is_fast(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_default_system_message_and_generation_prompt(tokenizer):
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert all(isinstance(i, int) for i in ids)
    text = tokenizer.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_matches_transformers_tokenized_output(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    ids = apply_chat_template(tokenizer, messages)
    assert ids == expected
    assert DEFAULT_SYSTEM not in tokenizer.decode(ids)


def test_list_of_text_parts_is_joined(tokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    joined = apply_chat_template(tokenizer, [{"role": "user", "content": "first\nsecond"}])
    assert apply_chat_template(tokenizer, [{"role": "user", "content": parts}]) == joined


def test_non_text_parts_are_rejected_by_name(tokenizer):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValueError, match="image_url"):
        apply_chat_template(tokenizer, [{"role": "user", "content": parts}])


def test_continue_final_message(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    ids = apply_chat_template(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(ValueError, match="mutually exclusive"):
        apply_chat_template(tokenizer, messages, continue_final_message=True)


def test_missing_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, messages)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = apply_chat_template(tokenizer, messages, chat_template=template)
    assert ids == tokenizer.encode("hi")


def test_bos_from_template_is_not_doubled(tokenizer, monkeypatch):
    # SmolLM adds no BOS when encoding; act like a tokenizer that does (Llama-style).
    encode = tokenizer.encode

    def encode_adding_bos(text, add_special_tokens=True, **kwargs):
        ids = encode(text, add_special_tokens=False, **kwargs)
        return [tokenizer.bos_token_id, *ids] if add_special_tokens else ids

    monkeypatch.setattr(tokenizer, "encode", encode_adding_bos)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    ids = apply_chat_template(tokenizer, messages, chat_template=template)
    assert ids == [tokenizer.bos_token_id, *tokenizer.encode("hi", add_special_tokens=False)]
