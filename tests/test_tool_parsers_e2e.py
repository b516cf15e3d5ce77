"""A new tool parser end to end: `engine serve --enable-auto-tool-choice --tool-call-parser
qwen3_coder` on a tiny random model, the official openai client streaming a chat completion
with tools. A random model writes no calls of its own, so the output is forced into
Qwen3-Coder's XML by a structured_outputs regex (tool_choice stays "auto": the parser, not the
constraint, turns the text into calls); the streamed deltas join to a call whose arguments are
typed by the request's tool schema."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    }
]
# Qwen3-Coder's format, with a choice of values so the sampled model still picks.
XML = (
    r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n"
    r"</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def client(tiny_model):
    srv = Server(
        [
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--served-model-name",
            MODEL,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "qwen3_coder",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    c = openai.OpenAI(base_url=srv.api_url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()
    assert srv.stop() == 0, srv.stderr


def test_streamed_qwen3_coder_calls(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=TOOLS,
        stream=True,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": XML}},
    )
    content, names, ids, arguments, finish = "", [], [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.id is not None:
                names.append(call.function.name)
                ids.append(call.id)
                assert call.function.arguments == ""  # the name first
            else:
                arguments += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking."
    assert names == ["get_weather"] and ids[0].startswith("call_")
    parsed = json.loads(arguments)
    assert parsed["city"] in ("Paris", "Rome")
    assert isinstance(parsed["days"], int) and 1 <= parsed["days"] <= 7
    assert finish == "tool_calls"


def test_the_same_call_not_streamed(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=TOOLS,
        max_tokens=120,
        temperature=0.0,
        extra_body={"structured_outputs": {"regex": XML}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "days"}
