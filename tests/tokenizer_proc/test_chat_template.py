"""Chat template rendering with tools, tool results, assistant tool calls, the developer role
and chat_template_kwargs; --chat-template as a file or inline."""

from __future__ import annotations

import pytest

from tokenizer_proc.tokenizer import apply_chat_template, load_chat_template

# A tools-aware template in the style of Qwen2.5's: it reads tools, tool_calls (arguments as an
# object), tool_call_id and an enable_thinking switch.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</tool_call>{% endfor %}"
    "{{ m.content }}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.decode(apply_chat_template(tokenizer, messages, **kwargs))


def test_tools_tool_calls_and_tool_results(tokenizer):
    text = _render(tokenizer, CONVERSATION, chat_template=TOOLS_TEMPLATE, tools=TOOLS)
    assert text == (
        "<|im_start|>system\nTools: get_weather<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>get_weather(Paris)</tool_call><|im_end|>\n"
        "<|im_start|>tool\n22 C [call_1]<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_arguments_given_as_an_object_and_none_content(tokenizer):
    messages = [
        dict(
            CONVERSATION[1],
            content=None,
            tool_calls=[
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                }
            ],
        )
    ]
    assert "get_weather(Rome)</tool_call><|im_end|>" in _render(
        tokenizer, messages, chat_template=TOOLS_TEMPLATE, add_generation_prompt=False
    )


def test_arguments_that_are_not_json_are_refused(tokenizer):
    messages = [
        CONVERSATION[0],
        dict(
            CONVERSATION[1],
            tool_calls=[
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
            ],
        ),
    ]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        apply_chat_template(tokenizer, messages, chat_template=TOOLS_TEMPLATE)


def test_developer_is_system_unless_the_template_knows_it(tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # the default model's template: no developer role, so the message is its system prompt
    assert apply_chat_template(tokenizer, messages) == apply_chat_template(tokenizer, system)
    knows = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# developer #}"
    assert _render(tokenizer, messages, chat_template=knows) == "developer:Be brief.;user:Hi;"


def test_chat_template_kwargs(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    off = _render(
        tokenizer,
        messages,
        chat_template=TOOLS_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False},
    )
    on = _render(
        tokenizer,
        messages,
        chat_template=TOOLS_TEMPLATE,
        chat_template_kwargs={"enable_thinking": True},
    )
    assert off.endswith("assistant\n<think></think>") and on.endswith("assistant\n")
    for name in ("tools", "chat_template", "messages", "tokenize", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"may not set '{name}'"):
            apply_chat_template(tokenizer, messages, chat_template_kwargs={name: None})


def test_template_errors_are_value_errors(tokenizer):
    with pytest.raises(ValueError, match="the chat template failed"):
        apply_chat_template(
            tokenizer,
            [{"role": "user", "content": "Hi"}],
            chat_template="{{ raise_exception('no') }}",
        )


def test_load_chat_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0].content }}\n")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}\n"
    # inline, with escapes decoded as vLLM does; characters beyond latin-1 survive
    assert load_chat_template("{{ 'é→' }}\\n") == "{{ 'é→' }}\n"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
