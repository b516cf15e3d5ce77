"""Loading a model's tokenizer and rendering chat messages to prompt token ids."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import jinja2

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded: it takes seconds
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# tokenizer_config.json classes that name the generic fast tokenizer itself (transformers 5
# calls it TokenizersBackend). Loaded directly, they skip AutoTokenizer's model-config lookup
# and torch: 0.4 s against 4.5 s for the default model here, after transformers' own import.
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the (fast) tokenizer of a local model directory without touching the hub."""
    began = time.perf_counter()
    if _tokenizer_class(path) in _GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        from transformers import AutoTokenizer  # imports torch, through the model configs

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    logger.info(
        "tokenizer loaded in %.2f s (with importing transformers)", time.perf_counter() - began
    )
    return tokenizer


def _tokenizer_class(path: str | os.PathLike[str]) -> str | None:
    """The tokenizer_class of path/tokenizer_config.json, None when it names none."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text, or else the value itself as an inline
    Jinja template (backslash escapes such as \\n decoded). A value with none of '{', '}' or a
    newline is taken for a file name, so a file that cannot be read is an error."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"the chat template {value!r} looks like a file path, but it could not be read: {e}"
            ) from None
    # Characters beyond latin-1 travel as \u escapes, which unicode_escape turns back.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


@functools.cache
def reserved_template_kwargs() -> frozenset[str]:
    """Names apply_chat_template and the template renderer take themselves: a request's
    chat_template_kwargs may not set them (vLLM refuses such collisions too)."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    return frozenset(
        {
            "messages",
            *inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters,
            *inspect.signature(render_jinja_template).parameters,
        }
        - {"self", "kwargs"}
    )


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The extra template variables, or ValueError naming one the server sets itself."""
    clashes = sorted(set(kwargs or ()) & reserved_template_kwargs()) if kwargs else []
    if clashes:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(map(repr, clashes))}: "
            "the server passes these to the chat template itself (use the "
            "request's own fields)"
        )
    return dict(kwargs or {})


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Render OpenAI-style chat messages with the chat template and return token ids.

    tools (OpenAI's {"type": "function", "function": {...}} dicts) go to the template as
    transformers passes them; chat_template_kwargs are extra template variables. Assistant
    tool_calls arguments given as JSON text reach the template as objects, and a developer
    message is a system message unless the template knows the developer role.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass chat_template "
            "(a Jinja template string) or use a model that ships one"
        )
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    template = tokenizer.get_chat_template(chat_template, tools)
    knows_developer = "developer" in template
    conversation = [_template_message(m, i, knows_developer) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None
    # The template writes any BOS itself; letting the encoder add special tokens would double it
    # (vLLM's add_special_tokens, false unless a request asks).
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _template_message(message: dict[str, Any], index: int, knows_developer: bool) -> dict[str, Any]:
    """The message as chat templates expect it (vLLM's conversions)."""
    message = _flatten_content(message)
    if message.get("content") is None:
        message = {**message, "content": ""}
    if message.get("role") == "developer" and not knows_developer:
        message = {**message, "role": "system"}
    if message.get("tool_calls"):
        calls = [
            _template_call(call, f"messages[{index}].tool_calls[{j}]")
            for j, call in enumerate(message["tool_calls"])
        ]
        message = {**message, "tool_calls": calls}
    return message


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool call with its arguments as an object (transformers' convention for templates)."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    return {**call, "function": {**function, "arguments": arguments}}


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
