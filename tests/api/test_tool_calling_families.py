"""The new tool parsers in /v1/chat/completions, in-process against a scripted TokenizerClient:
Mistral's call ids (9 alphanumerics) in both answer shapes, the request's tool schemas reaching
qwen3_coder (values typed by them), special tokens kept for marker formats, and the parser
names --tool-call-parser accepts."""

from __future__ import annotations

import json

import pytest

from frontend.chat_args import PARSER_NAMES, ChatOptions
from serve.cli import build_parser
from tests.api.test_tool_calling import TOOLS, post

MISTRAL_OUTPUT = [
    "Sure.[TOOL",
    '_CALLS]get_weather[ARGS]{"city": ',
    '"Paris"}[TOOL_CALLS]get_time{}',
]
QWEN_OUTPUT = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n",
    "Paris\n</parameter>\n<parameter=days>\n3\n</param",
    "eter>\n</function>\n</tool_call>",
]
QWEN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def _is_mistral_id(value: str) -> bool:
    return len(value) == 9 and value.isalnum() and value.isascii()


def test_mistral_answer_has_mistral_ids():
    _, answer, client = post(dict(tools=TOOLS), pieces=MISTRAL_OUTPUT, tool_parser="mistral")
    assert client.requests[0].sampling_params.skip_special_tokens is False
    message = answer["choices"][0]["message"]
    assert message["content"] == "Sure."
    calls = message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    assert all(_is_mistral_id(c["id"]) for c in calls)
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_mistral_stream_has_mistral_ids():
    _, chunks, _ = post(
        dict(tools=TOOLS, stream=True), pieces=MISTRAL_OUTPUT, tool_parser="mistral"
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    firsts = [c for c in calls if "id" in c]
    assert [c["function"]["name"] for c in firsts] == ["get_weather", "get_time"]
    assert all(_is_mistral_id(c["id"]) for c in firsts)
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 0) == (
        '{"city": "Paris"}'
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_values_typed_by_the_request_tools(stream):
    _, answer, _ = post(
        dict(tools=QWEN_TOOLS, stream=stream), pieces=QWEN_OUTPUT, tool_parser="qwen3_coder"
    )
    if stream:
        deltas = [c["choices"][0]["delta"] for c in answer]
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        name = calls[0]["function"]["name"]
        arguments = "".join(c["function"]["arguments"] for c in calls)
    else:
        call = answer["choices"][0]["message"]["tool_calls"][0]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris", "days": 3}  # days: an integer


@pytest.mark.parametrize(
    "parser,pieces,names",
    [
        ("pythonic", ['[get_weather(city="Pa', 'ris"), get_time()]'], ["get_weather", "get_time"]),
        ("granite", ['<|tool_call|>[{"name": "get_time", "arguments": {}}]'], ["get_time"]),
        ("phi4_mini_json", ['functools[{"name": "get_time", "arguments": {}}]'], ["get_time"]),
        (
            "deepseek_v3",
            [
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
            ],
            ["get_time"],
        ),
    ],
)
def test_each_parser_serves_auto(parser, pieces, names):
    _, answer, _ = post(dict(tools=TOOLS), pieces=pieces, tool_parser=parser)
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == names
    assert answer["choices"][0]["message"]["content"] is None


@pytest.mark.parametrize(
    "name",
    [
        "mistral",
        "pythonic",
        "llama4_pythonic",
        "qwen3_coder",
        "granite",
        "deepseek_v3",
        "phi4_mini_json",
    ],
)
def test_tool_call_parser_flag_accepts_the_new_names(name):
    assert name in PARSER_NAMES
    args = build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", name]
    )
    assert ChatOptions.from_args(args).auto_tool_parser == name
