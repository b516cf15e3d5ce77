"""Tool calling in /v1/chat/completions, in-process against a scripted TokenizerClient: what
reaches the tokenizer process (tools, the constraint of "required" and a named function),
the refusals, and the answers in OpenAI's shapes, streamed and not."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine_core.structured_output.grammar import check_grammar
from frontend.api_server import build_app
from frontend.serving import ServingContext
from protocol.sampling_params import StructuredOutputsParams
from protocol.tokenizer import RequestDelta

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedClient:
    """Answers every request with the same pieces of text per choice, choices interleaved."""

    def __init__(self, pieces: list[str], finish_reason: str = "stop") -> None:
        self.pieces = pieces
        self.finish_reason = finish_reason
        self.requests: list = []

    async def generate(self, request):
        self.requests.append(request)
        for j, piece in enumerate(self.pieces):
            last = j == len(self.pieces) - 1
            for i in range(request.sampling_params.n):
                yield RequestDelta(
                    request.request_id,
                    i,
                    piece,
                    [1],
                    num_prompt_tokens=3,
                    finish_reason=self.finish_reason if last else None,
                )


def post(
    body: dict, pieces: list[str] | None = None, finish_reason: str = "stop", **ctx_fields
) -> tuple[int, object, ScriptedClient]:
    """POST body to /v1/chat/completions; (status, JSON or SSE events, the client)."""
    client = ScriptedClient(pieces or ["Hello"], finish_reason)

    async def run():
        app = build_app(ServingContext("m", 256, 100, client, None, **ctx_fields))
        async with TestClient(TestServer(app)) as http:
            resp = await http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
            if resp.content_type == "text/event-stream":
                text = await resp.text()
                return resp.status, [
                    json.loads(line[6:])
                    for line in text.split("\n\n")
                    if line.startswith("data: {")
                ]
            return resp.status, await resp.json()

    status, answer = asyncio.run(run())
    return status, answer, client


def refused(body: dict, **ctx_fields) -> dict:
    status, answer, client = post(body, **ctx_fields)
    assert status == 400 and not client.requests, answer
    return answer["error"]


# ---- refusals ----


@pytest.mark.parametrize(
    "body,param,words",
    [
        (dict(tools=TOOLS), "tool_choice", "--enable-auto-tool-choice"),
        (dict(tools=TOOLS, tool_choice="auto"), "tool_choice", "--tool-call-parser"),
        (dict(tool_choice="required"), "tool_choice", "`tools` must be set"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
            "'nope' has not been passed",
        ),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
        (
            dict(tools=[{"type": "custom", "function": {"name": "f"}}], tool_choice="none"),
            "tools[0].type",
            "only 'function'",
        ),
        (dict(tools=[TOOLS[0], TOOLS[0]], tool_choice="none"), "tools[1].function.name", "twice"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                tool_choice="required",
            ),
            "tools",
            "nonsense",
        ),
        (
            dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
            "cannot be combined",
        ),
        (
            dict(tools=TOOLS, tool_choice="required", structured_outputs={"regex": "a"}),
            "structured_outputs",
            "give it once",
        ),
        (dict(prediction={"type": "content", "content": "x"}), "prediction", "not supported"),
        (dict(functions=[{"name": "f"}]), "functions", "use tools"),
        (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs", "'tools'"),
        (
            dict(chat_template_kwargs={"add_generation_prompt": False}),
            "chat_template_kwargs",
            "add_generation_prompt",
        ),
        (
            dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
            "messages[0].tool_calls",
            "only assistant",
        ),
    ],
)
def test_refusals_name_the_field(body, param, words):
    error = refused(body)
    assert error["param"] == param and words in error["message"], error


def test_annotation_fields_are_accepted_and_ignored():
    status, answer, _ = post(dict(metadata={"k": "v"}, store=True, service_tier="auto", user="u"))
    assert status == 200, answer


# ---- what reaches the tokenizer process ----


def test_named_function_is_constrained_to_its_parameters():
    status, answer, client = post(
        dict(
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            structured_outputs={"disable_any_whitespace": True},
        ),  # options may refine it
        pieces=['{"city": ', '"Paris"}'],
    )
    request = client.requests[0]
    assert request.tools == TOOLS  # to the chat template, as OpenAI sent them
    assert request.sampling_params.structured_outputs == StructuredOutputsParams(
        json=WEATHER_PARAMS, disable_any_whitespace=True
    )
    choice = answer["choices"][0]
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls(parallel):
    calls = [
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "get_time", "parameters": {}},
    ]
    status, answer, client = post(
        dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel),
        pieces=[json.dumps(calls)],
    )
    schema = client.requests[0].sampling_params.structured_outputs.json
    check_grammar(client.requests[0].sampling_params.structured_outputs)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert ("maxItems" in schema) != parallel
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in answer["choices"][0]["message"]["tool_calls"]
    ]
    assert got == [("get_weather", {"city": "Oslo"}), ("get_time", {})][: 2 if parallel else 1]


def test_required_moves_defs_to_the_top():
    params = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}},
    }
    _, _, client = post(
        dict(
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
        )
    )
    schema = client.requests[0].sampling_params.structured_outputs.json
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


def test_tool_choice_none_renders_tools_and_returns_text():
    status, answer, client = post(
        dict(tools=TOOLS, tool_choice="none"),
        pieces=['<tool_call>{"name": "x"}</tool_call>'],
        tool_parser="hermes",
    )
    assert client.requests[0].tools == TOOLS
    assert client.requests[0].sampling_params.structured_outputs is None
    message = answer["choices"][0]["message"]
    assert message["content"] == '<tool_call>{"name": "x"}</tool_call>'
    assert message["tool_calls"] is None and answer["choices"][0]["finish_reason"] == "stop"


def test_history_with_calls_tool_results_and_developer():
    history = [
        {"role": "developer", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
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
    status, _, client = post(
        dict(
            messages=history,
            tools=TOOLS,
            tool_choice="none",
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    request = client.requests[0]
    assert status == 200
    assert request.messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert request.messages[3] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}
    assert request.messages[0]["role"] == "developer"  # the tokenizer process maps it
    assert request.chat_template_kwargs == {"enable_thinking": False}


# ---- auto, with a parser ----

HERMES_OUTPUT = [
    "I'll check",
    ".\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>\n<tool_call>',
    '{"name": "get_time", "arguments": {}}</tool_call>',
]


def test_auto_non_streaming():
    status, answer, client = post(
        dict(tools=TOOLS, n=2), pieces=HERMES_OUTPUT, tool_parser="hermes"
    )
    assert client.requests[0].sampling_params.skip_special_tokens is False  # as vLLM's hermes
    assert client.requests[0].sampling_params.structured_outputs is None
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:
        assert choice["message"]["content"] == "I'll check."
        assert [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]
        ] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        assert choice["finish_reason"] == "tool_calls"
    ids = [c["id"] for choice in answer["choices"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 4


def test_auto_without_parallel_keeps_the_first_call():
    _, answer, _ = post(
        dict(tools=TOOLS, parallel_tool_calls=False),
        pieces=HERMES_OUTPUT,
        tool_parser="llama3_json",
    )
    assert answer["choices"][0]["message"]["tool_calls"] is None  # not llama3's format
    _, answer, _ = post(
        dict(tools=TOOLS, parallel_tool_calls=False), pieces=HERMES_OUTPUT, tool_parser="hermes"
    )
    assert [c["function"]["name"] for c in answer["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"
    ]


def test_a_cut_off_call_keeps_finish_reason_length():
    _, answer, _ = post(
        dict(tools=TOOLS), pieces=HERMES_OUTPUT[:4], finish_reason="length", tool_parser="hermes"
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] is None


def test_auto_streaming_deltas_as_openai_sends_them():
    status, chunks, _ = post(
        dict(tools=TOOLS, n=2, stream=True), pieces=HERMES_OUTPUT, tool_parser="hermes"
    )
    assert status == 200
    for index in (0, 1):
        choices = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        deltas = [c["delta"] for c in choices]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas) == "I'll check."
        calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert all(len(c) == 1 for c in calls)
        calls = [c[0] for c in calls]
        # per call: index, id, type and name with empty arguments, then arguments only
        firsts = [c for c in calls if "id" in c]
        assert [(c["index"], c["type"], c["function"]) for c in firsts] == [
            (0, "function", {"name": "get_weather", "arguments": ""}),
            (1, "function", {"name": "get_time", "arguments": ""}),
        ]
        for c in calls:
            if "id" not in c:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
        args = [
            "".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)
        ]
        assert args == ['{"city": "Paris"}', "{}"]
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "tool_calls"


def test_named_streaming():
    _, chunks, _ = post(
        dict(
            tools=TOOLS,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        pieces=[' {"city"', ': "Rome"}'],
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert (
        "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:])
        == '{"city": "Rome"}'
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- the answer's role ----


def test_response_role():
    _, answer, _ = post({}, response_role="bot")
    assert answer["choices"][0]["message"]["role"] == "bot"
    _, chunks, _ = post(dict(stream=True), response_role="bot")
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    # continuing a message answers in that message's role (vLLM's rule)
    _, answer, _ = post(
        dict(
            messages=[*MESSAGES, {"role": "assistant", "content": "It"}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        response_role="bot",
    )
    assert answer["choices"][0]["message"]["role"] == "assistant"
