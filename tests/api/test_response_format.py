"""response_format and structured_outputs on both endpoints: what StructuredOutputsParams they
become, and the 400s for invalid or conflicting constraints (before the engine sees them)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend.api_server import build_app
from frontend.errors import ApiError
from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from frontend.response_format import requested_constraint
from frontend.serving import ServingContext
from protocol.sampling_params import StructuredOutputsParams
from tests.api.test_tool_calling import ScriptedClient

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f>"],
}
XGRAMMAR_TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}


def _base(struct) -> dict:
    return (
        {"prompt": "x"}
        if struct is CompletionRequest
        else {"messages": [{"role": "user", "content": "x"}]}
    )


@pytest.mark.parametrize("struct", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize(
    "fields,expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "answer",
                        "description": "d",
                        "schema": SCHEMA,
                        "strict": True,
                    },
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"response_format": LEGACY_TAG}, StructuredOutputsParams(structural_tag=LEGACY_TAG)),
        ({"response_format": XGRAMMAR_TAG}, StructuredOutputsParams(structural_tag=XGRAMMAR_TAG)),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutputsParams(choice=["yes", "no"]),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            StructuredOutputsParams(grammar='root ::= "a" | "b"'),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        # options alone refine response_format's constraint, as vLLM merges them
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"disable_any_whitespace": True},
            },
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
    ],
)
def test_mapping(struct, fields, expected):
    req = msgspec.convert({**_base(struct), **fields}, struct)
    assert requested_constraint(req) == expected


@pytest.mark.parametrize(
    "fields,param,words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format",
            "schema is required",
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
            "nope",
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": []}},
            "response_format",
            "triggers",
        ),
        (
            {"structured_outputs": {"regex": "a(b"}},
            "structured_outputs",
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"grammar": "root ::= ("}},
            "structured_outputs",
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "give it once",
        ),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs",
            "exactly one of",
        ),
    ],
)
def test_invalid_constraint_is_a_400(fields, param, words):
    req = msgspec.convert({"prompt": "x", **fields}, CompletionRequest)
    with pytest.raises(ApiError) as info:
        requested_constraint(req)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message, info.value.message


def _post(path: str, body: dict) -> tuple[int, dict, ScriptedClient]:
    client = ScriptedClient(['{"answer": 4}'])

    async def run():
        app = build_app(ServingContext("m", 256, 100, client, None))
        async with TestClient(TestServer(app)) as http:
            resp = await http.post(path, json=body)
            return resp.status, await resp.json()

    status, answer = asyncio.run(run())
    return status, answer, client


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "2+2=", "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2?"}], "n": 2}),
    ],
)
def test_both_endpoints_send_the_constraint(path, body):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    status, answer, client = _post(path, {**body, "response_format": fmt})
    assert status == 200, answer
    assert client.requests[0].sampling_params.structured_outputs == StructuredOutputsParams(
        json=SCHEMA
    )
    status, answer, client = _post(path, {**body, "structured_outputs": {"regex": "a("}})
    assert status == 400 and answer["error"]["param"] == "structured_outputs"
    assert not client.requests
    status, answer, _ = _post(path, {**body, "structured_outputs": {"regex": "a", "x": 1}})
    assert status == 400 and answer["error"]["param"] == "structured_outputs.x"
    status, answer, _ = _post(path, {**body, "response_format": {"type": "xml"}})
    assert status == 400 and answer["error"]["param"] == "response_format.type"


_IMPORT_PROBE = """
import asyncio, sys, time
from frontend.openai_protocol import CompletionRequest
from frontend.response_format import load_grammar_library

async def main():
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    plain = CompletionRequest(model="m", prompt="x")
    await load_grammar_library(plain)  # no constraint asked: nothing imported
    assert "engine_core.structured_output.grammar" not in sys.modules
    req = CompletionRequest(model="m", prompt="x", response_format={"type": "json_object"})
    start = time.perf_counter()
    await asyncio.gather(load_grammar_library(req), load_grammar_library(req))
    took = time.perf_counter() - start
    task.cancel()
    during = [t for t in ticks if t >= start]
    gap = max(b - a for a, b in zip(during, during[1:]))
    print(took, gap, "engine_core.structured_output.grammar" in sys.modules)

asyncio.run(main())
"""


def test_first_constrained_request_imports_the_grammar_library_off_the_loop():
    """xgrammar takes seconds to import: the event loop keeps running meanwhile (other streams
    are served), where an import on the loop stalled it for the whole time."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    took, gap, loaded = float(out[0]), float(out[1]), out[2]
    assert loaded == "True"
    assert gap < took / 3, (took, gap)
