"""frontend/harmony_prompt.py: OpenAI chat messages rendered for gpt-oss equal the conversation
built with openai-harmony's own types as its guide places them (system message with date and
reasoning effort, developer message with the instructions and the function tools)."""

from __future__ import annotations

import json

import pytest

from frontend.harmony_prompt import harmony_messages, render_prompt
from tests.api.harmony_vocab import encoding

DATE = "2026-11-27"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _by_hand(*rest, effort="high", instructions="Answer in French.", tools=True):
    """The expected prompt, built from harmony's types directly."""
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(DATE)
    )
    developer = DeveloperContent.new().with_instructions(instructions)
    if tools:
        f = WEATHER["function"]
        developer = developer.with_function_tools(
            [ToolDescription.new(f["name"], f["description"], f["parameters"])]
        )
    messages = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        *rest,
    ]
    return encoding().render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT
    )


def test_system_user_and_a_tool():
    from openai_harmony import Message, Role

    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    ]
    ids = render_prompt(encoding(), messages, [WEATHER], "high", start_date=DATE)
    assert ids == _by_hand(Message.from_role_and_content(Role.USER, "Weather in Paris?"))
    text = encoding().decode(ids)
    for part in (
        "Reasoning: high",
        f"Current date: {DATE}",
        "# Instructions\n\nAnswer in French.",
        "namespace functions",
        "// The weather in a city.\ntype get_weather = (_: {\ncity: string,\n}) => any;",
        "Calls to these tools must go to the commentary channel: 'functions'.",
        "<|start|>user<|message|>Weather in Paris?<|end|>",
    ):
        assert part in text
    assert text.endswith("<|start|>assistant")


def test_a_call_and_its_result_in_the_history():
    from openai_harmony import Author, Message, Role

    args = {"city": "Paris"}
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    ids = render_prompt(encoding(), messages, [WEATHER], "low", start_date=DATE)
    expected = _by_hand(
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I should call the tool.").with_channel(
            "analysis"
        ),
        Message.from_role_and_content(Role.ASSISTANT, json.dumps(args))
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(
            Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}'
        )
        .with_channel("commentary")
        .with_recipient("assistant"),
        effort="low",
    )
    assert ids == expected


def test_an_earlier_answer_goes_to_the_final_channel():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    text = encoding().decode(render_prompt(encoding(), messages, start_date=DATE))
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert "<|start|>developer" not in text  # no instructions, no tools: no developer message
    assert "Reasoning: medium" in text  # harmony's default effort
    assert "Greet back." not in text  # harmony drops a finished turn's reasoning
    assert text.endswith("<|start|>user<|message|>Bye<|end|><|start|>assistant")
    assert render_prompt(encoding(), messages, add_generation_prompt=False, start_date=DATE) == (
        encoding().encode(text.removesuffix("<|start|>assistant"), allowed_special="all")
    )


def test_a_tool_result_without_its_call_is_refused():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "tool", "tool_call_id": "call_unknown", "content": "42"},
    ]
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool result needs the tool_call_id"):
        harmony_messages(messages)
