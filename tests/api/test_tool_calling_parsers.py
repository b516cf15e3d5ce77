"""Tool call parsers on text: whole outputs (extract) and the same outputs streamed in pieces of
every size, which must join to the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from frontend.tool_parsers import TOOL_PARSERS
from frontend.tool_parsers.forced import NamedFunctionParser, RequiredParser
from frontend.tool_parsers.hermes import HermesToolParser
from frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend.tool_parsers.streamer import ToolCall, ToolCallDelta, collect


def _streamed(parser, text: str, sizes) -> list:
    events, i = [], 0
    while i < len(text):
        size = next(sizes)
        events += parser.feed(text[i : i + size])
        i += size
    return events + parser.finish()


def _chunkings(seed: int = 0):
    """Piece sizes: one character at a time, fixed sizes, random sizes, all at once."""
    rng = random.Random(seed)
    yield iter(lambda: 1, None)
    for n in (2, 3, 7):
        yield iter(lambda n=n: n, None)
    yield iter(lambda: rng.randint(1, 12), None)
    yield iter(lambda: 10**6, None)


def _check_streams(make, text: str, expected_content, expected_calls) -> None:
    extracted = make().extract(text)
    assert extracted.content == expected_content
    assert extracted.calls == expected_calls
    for sizes in _chunkings():
        events = _streamed(make(), text, sizes)
        assert collect(events) == extracted
        # Per call: its name first (with empty arguments), then only argument pieces.
        seen = set()
        for e in events:
            if isinstance(e, ToolCallDelta):
                assert (e.name is not None) == (e.index not in seen)
                assert e.name is None or e.arguments == ""
                seen.add(e.index)


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            f"<tool_call>\n{WEATHER}\n</tool_call>",
            None,
            [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')],
        ),
        (
            f"Let me look.\n\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
            '{"arguments": {"q": "a \\"quoted\\" }"}, "name": "search"}</tool_call>\n',
            "Let me look.",
            [
                ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                ToolCall("search", '{"q": "a \\"quoted\\" }"}'),
            ],
        ),
        # the last call may lack its closing tag
        (
            f"Sure <tool_call>{WEATHER}",
            "Sure",
            [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')],
        ),
        # "parameters" is read too; no arguments at all is {}; a string of JSON is taken as such
        (
            '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call>'
            '<tool_call>{"name": "c", "arguments": "{\\"y\\": 2}"}</tool_call>',
            None,
            [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}"), ToolCall("c", '{"y": 2}')],
        ),
        # a closing tag inside a string is text
        (
            '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call> done',
            " done",
            [ToolCall("f", '{"s": "</tool_call>"}')],
        ),
        # no calls: all content, a partial tag at the end included
        ("Just text, no tools. <tool_c", "Just text, no tools. <tool_c", []),
    ],
)
def test_hermes(text, content, calls):
    _check_streams(HermesToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>',  # not JSON
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # a name that is no string
        "<tool_call>no json here</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut off
    ],
)
def test_hermes_malformed_call_stays_content(text):
    out = HermesToolParser().extract("Before " + text + " after")
    assert out.calls == []
    assert out.content == "Before " + text + " after"


def test_hermes_malformed_after_a_good_call():
    out = HermesToolParser().extract(
        f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{oops}}</tool_call>"
    )
    assert [c.name for c in out.calls] == ["get_weather"]
    assert out.content == "\n<tool_call>{oops}</tool_call>"  # as written


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [ToolCall("get_weather", '{"city": "Paris"}')],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
            None,
            [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")],
        ),
        (
            '  \n{"name": "a", "parameters": {"nested": {"k": [1, {"z": null}]}}}',
            None,
            [ToolCall("a", '{"nested": {"k": [1, {"z": null}]}}')],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ('Call {"name": "a", "parameters": {}}', 'Call {"name": "a", "parameters": {}}', []),
        ("<|python_ta", "<|python_ta", []),
    ],
)
def test_llama3_json(text, content, calls):
    _check_streams(Llama3JsonToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": {"x": ',
        '{"nam": "a", "parameters": {}}',
        '{"name": "a", "parameters": {"x": tru}}',
    ],
)
def test_llama3_json_malformed_stays_content(text):
    assert Llama3JsonToolParser().extract(text) == (text, [])


def test_registry_has_vllm_names():
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser


def test_named_function_output_is_the_arguments():
    text = ' \n{"city": "Paris",\n "unit": "C"}\n '
    _check_streams(
        lambda eager=True: NamedFunctionParser("get_weather", eager),
        text,
        None,
        [ToolCall("get_weather", '{"city": "Paris",\n "unit": "C"}')],
    )


def test_required_output_is_an_array_of_calls():
    calls = [{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}]
    text = json.dumps(calls, indent=2)
    out = RequiredParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("a", {"x": [1, 2]}),
        ("b", {}),
    ]
    _check_streams(RequiredParser, text, None, out.calls)
    assert RequiredParser().extract("not an array") == ("not an array", [])
