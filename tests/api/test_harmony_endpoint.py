"""A gpt-oss chat reply through `engine serve`'s /v1/chat/completions: a tiny GptOssForCausalLM
built to answer known harmony completions (tests/api/harmony_model.py) gives reasoning apart
from content, a tool call as an OpenAI tool call, streamed and not, and a reply cut by
max_tokens inside the analysis keeps its partial reasoning."""

from __future__ import annotations

import json

import pytest

from frontend.harmony_prompt import render_prompt
from tests.api.harmony_model import make_harmony_model
from tests.api.harmony_vocab import encoding
from tests.serve.conftest import Server

REASONING = "Greet back."
FINAL = "Hi there!"
CALL_REASONING = "Call the tool."
ARGS = '{"city":"Paris"}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HELLO = [{"role": "user", "content": "Hello"}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]


def _completions() -> tuple[list[int], list[int]]:
    enc = encoding()
    answer = enc.encode(
        f"<|channel|>analysis<|message|>{REASONING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>",
        allowed_special="all",
    )
    call = enc.encode(
        f"<|channel|>analysis<|message|>{CALL_REASONING}<|end|><|start|>assistant"
        f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
        "<|call|>",
        allowed_special="all",
    )
    return answer, call


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    enc = encoding()
    answer, call = _completions()
    # The prompts as the server renders them (today's date included).
    conversations = [
        (render_prompt(enc, HELLO), answer),
        (render_prompt(enc, ASK, [WEATHER]), call),
    ]
    model = make_harmony_model(tmp_path_factory.mktemp("gpt-oss"), conversations)
    srv = Server(
        [
            "--model",
            str(model),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "512",
            "--served-model-name",
            "gpt-oss",
            "--enable-auto-tool-choice",  # as vLLM's gpt-oss recipe passes them
            "--tool-call-parser",
            "openai",
        ],
        timeout=300,
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def client(server):
    import openai

    c = openai.OpenAI(base_url=server.api_url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def _stream(client, **kwargs) -> dict:
    """The streamed deltas of one choice put back together."""
    out = {"content": "", "reasoning": "", "reasoning_content": "", "calls": {}, "finish": None}
    for chunk in client.chat.completions.create(model="gpt-oss", stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            for name in ("reasoning", "reasoning_content"):
                out[name] += _extra(delta, name) or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, ["", ""])
                if call.function.name:
                    entry[0] = call.function.name
                entry[1] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_reasoning_apart_from_content(client):
    reply = client.chat.completions.create(model="gpt-oss", messages=HELLO, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == FINAL
    assert _extra(choice.message, "reasoning") == REASONING
    assert _extra(choice.message, "reasoning_content") == REASONING
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    streamed = _stream(client, messages=HELLO, temperature=0)
    assert streamed == {
        "content": FINAL,
        "reasoning": REASONING,
        "reasoning_content": REASONING,
        "calls": {},
        "finish": "stop",
    }


def test_a_tool_call(client):
    reply = client.chat.completions.create(
        model="gpt-oss", messages=ASK, tools=[WEATHER], temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert _extra(choice.message, "reasoning") == CALL_REASONING
    assert not choice.message.content
    streamed = _stream(client, messages=ASK, tools=[WEATHER], temperature=0)
    assert streamed["calls"] == {0: ["get_weather", ARGS]}
    assert streamed["finish"] == "tool_calls" and streamed["reasoning"] == CALL_REASONING


def test_cut_inside_the_analysis(client):
    reply = client.chat.completions.create(
        model="gpt-oss", messages=HELLO, temperature=0, max_tokens=5
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    reasoning = _extra(choice.message, "reasoning")
    assert reasoning and reasoning != REASONING and REASONING.startswith(reasoning)
    streamed = _stream(client, messages=HELLO, temperature=0, max_tokens=5)
    assert streamed["reasoning"] == reasoning and streamed["finish"] == "length"


def test_tokenize_renders_as_chat_does(server):
    import requests

    body = {"messages": ASK, "tools": [WEATHER]}
    reply = requests.post(server.api_url + "/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == render_prompt(encoding(), ASK, [WEATHER])


def test_a_grammar_is_refused(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="not supported for gpt-oss"):
        client.chat.completions.create(
            model="gpt-oss", messages=HELLO, response_format={"type": "json_object"}
        )
