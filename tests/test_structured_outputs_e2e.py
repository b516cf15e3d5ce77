"""Structured outputs and tool calling end to end: the official openai client against a real
`engine serve` of a tiny random model. Whatever the weights, every output obeys its
constraint: response_format (a pydantic model through chat.completions.parse, json_schema),
structured_outputs (regex, choice), streamed and not, n=3 at temperature 1; tool_choice
required and named give calls whose arguments validate against the tool's parameters; a tool
conversation (call, result, answer) completes.

JSON constraints here add structured_outputs {"disable_any_whitespace": true} (vLLM's option,
merged into response_format's and the tools' constraints): JSON allows any whitespace between
tokens, and a random model, unlike a trained one, fills its budget with it."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded, so that a random model must close it: after the last brace only EOS is allowed.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
SAMPLED = dict(n=3, temperature=1.0, max_tokens=120, seed=7)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tiny_model):
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
            "hermes",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.api_url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def _texts(client, stream: bool, **kwargs) -> list[str]:
    """Each choice's text (chat), after checking it ended with stop."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert all(c.finish_reason == "stop" for c in out.choices), out
        return [c.message.content for c in out.choices]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **kwargs
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish.values()) == {"stop"}, (finish, texts)
    return [texts[i] for i in sorted(texts)]


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Weather,
        temperature=0.0,
        max_tokens=120,
        extra_body=COMPACT,
    )
    assert isinstance(out.choices[0].message.parsed, Weather), out


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(client, stream):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    texts = _texts(client, stream, response_format=fmt, extra_body=COMPACT, **SAMPLED)
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "constraint,check",
    [
        ({"regex": r"(cat|dog)-[0-9]{2}"}, lambda t: re.fullmatch(r"(cat|dog)-[0-9]{2}", t)),
        (
            {"choice": ["alpha", "beta", "gamma delta"]},
            lambda t: t in ("alpha", "beta", "gamma delta"),
        ),
    ],
)
def test_regex_and_choice(client, stream, constraint, check):
    texts = _texts(client, stream, extra_body={"structured_outputs": constraint}, **SAMPLED)
    assert len(texts) == 3 and all(check(t) for t in texts), texts


def test_completions_endpoint(client):
    out = client.completions.create(
        model=MODEL,
        prompt="A color:",
        n=3,
        temperature=1.0,
        max_tokens=20,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert [c.text in ("red", "blue") for c in out.choices] == [True] * 3, out


def _check_calls(calls, names) -> None:
    assert calls, calls
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# "required" without parallel_tool_calls: one call, so a random model must end the array.
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_tool_calls_validate(client, choice):
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    kwargs = dict(
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, extra_body=COMPACT, **SAMPLED
    )
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c
        _check_calls(c.message.tool_calls, names)
    # streamed: the pieces join to calls that validate too
    calls: dict[tuple[int, int], dict] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **kwargs
    ):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault((c.index, d.index), {"arguments": ""})
                if d.id:
                    call.update(id=d.id, name=d.function.name)
                call["arguments"] += d.function.arguments or ""
    assert {choice_index for choice_index, _ in calls} == {0, 1, 2}
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_parallel_calls_validate(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        extra_body=COMPACT,
        **SAMPLED,
    )
    for c in out.choices:  # may end at max_tokens: the complete calls count
        _check_calls(c.message.tool_calls, {"get_weather", "get_time"})


def test_a_tool_conversation_completes(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0.0,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=COMPACT,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
