"""Loading a model's tokenizer and rendering chat messages to prompt token ids."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the (fast) tokenizer of a local model directory without touching the hub."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
) -> list[int]:
    """Render OpenAI-style chat messages with the model's chat template and return token ids."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass chat_template "
            "(a Jinja template string) or use a model that ships one"
        )
    text = tokenizer.apply_chat_template(
        [_flatten_content(message) for message in messages],
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    # The template writes any BOS itself; letting the encoder add special tokens would double it.
    return tokenizer.encode(text, add_special_tokens=False)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """Return the message with list-of-parts content joined into one string (text parts only)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    unsupported = sorted({str(part.get("type")) for part in content if part.get("type") != "text"})
    if unsupported:
        raise ValueError(
            f"unsupported content part type(s): {', '.join(unsupported)}; only 'text' is supported"
        )
    # Newline-joined, as vLLM joins text parts for string-content templates.
    return {**message, "content": "\n".join(part["text"] for part in content)}
