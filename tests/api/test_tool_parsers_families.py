"""The tool call parsers of issue 31 on text (vLLM's names: mistral, pythonic, qwen3_coder,
granite, deepseek_v3, phi4_mini_json): whole outputs (extract) and the same outputs streamed in
pieces of every size, which must join to the same content and calls (name first, then
arguments); malformed output stays content, and no output raises."""

from __future__ import annotations

import functools
import json
import random

import pytest

from frontend.tool_parsers import TOOL_PARSERS
from frontend.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from frontend.tool_parsers.granite import GraniteToolParser
from frontend.tool_parsers.mistral import MistralToolParser
from frontend.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from frontend.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from frontend.tool_parsers.schema_values import convert_value
from frontend.tool_parsers.streamer import ToolCall, ToolCallDelta
from tests.api.test_tool_calling_parsers import _check_streams, _chunkings, _streamed

PARIS = ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
TIME = ToolCall("get_time", "{}")


# ---- mistral ----


@pytest.mark.parametrize(
    "text,content,calls",
    [
        # v11+: [TOOL_CALLS]name[ARGS]{...}, one marker per call, content before
        (
            'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
            "[TOOL_CALLS]get_time[ARGS]{}",
            "Let me check.",
            [PARIS, TIME],
        ),
        # a name directly followed by its object (a tokenizer without [ARGS])
        ('[TOOL_CALLS]get_weather{"city": "Paris", "days": [1, 2]}', None, [PARIS]),
        # before v11: a JSON list; other keys (the id) ignored
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": '
            '[1, 2]}, "id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}}]',
            None,
            [PARIS, TIME],
        ),
        # a string inside the arguments that looks like the marker is text
        (
            '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]g[ARGS]{}"}',
            None,
            [ToolCall("f", '{"s": "[TOOL_CALLS]g[ARGS]{}"}')],
        ),
        ("No tools needed. [TOOL_CA", "No tools needed. [TOOL_CA", []),
    ],
)
def test_mistral(text, content, calls):
    _check_streams(MistralToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]get_weather[ARGS]{bad json}",
        '[TOOL_CALLS]get_weather[ARGS]["not", "an object"]',
        "[TOOL_CALLS][ARGS]{}",  # no name
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": }]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut off
    ],
)
def test_mistral_malformed_stays_content(text):
    assert MistralToolParser().extract("Hi " + text) == ("Hi " + text, [])


def test_mistral_call_ids_are_nine_alphanumerics():
    ids = {MistralToolParser.call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


# ---- pythonic ----


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ('[get_weather(city="Paris", days=[1, 2]), get_time()]', None, [PARIS, TIME]),
        # single quotes, tuples, None/True, negative numbers, nested dicts, a trailing comma
        (
            " [f(a='x', b=(1, None), c=True, d=-2.5, e={'k': [1, {'z': \"q\"}]},)]",
            None,
            [
                ToolCall(
                    "f",
                    '{"a": "x", "b": [1, null], "c": true, "d": -2.5, "e": {"k": [1, {"z": "q"}]}}',
                )
            ],
        ),
        # brackets, commas and quotes inside strings; triple quotes; non-ASCII kept
        (
            '[f(s="a, b) ]", t="""it\'s "x\\"""", u="Zürich")]',
            None,
            [ToolCall("f", '{"s": "a, b) ]", "t": "it\'s \\"x\\"", "u": "Zürich"}')],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
)
def test_pythonic(text, content, calls):
    _check_streams(PythonicToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "[f(x=y)]",  # a name, not a literal
        "[f(x=__import__('os').getcwd())]",  # a call: never evaluated
        "[f(1)]",  # positional
        "[f(x=1e999)]",  # infinite
        "[f(x={1, 2})]",  # a set
        "[f(x=1",  # cut off
        "[f.g(x=1)]",
    ],
)
def test_pythonic_malformed_stays_content(text):
    assert PythonicToolParser().extract(text) == (text, [])


def test_pythonic_streams_each_argument_as_it_completes():
    parser = PythonicToolParser()
    events = parser.feed('[get_weather(city="Par')
    assert events == [ToolCallDelta(0, "get_weather", "")]
    assert parser.feed('is", ') == [ToolCallDelta(0, None, '{"city": "Paris"')]
    assert parser.feed("days=3)") == [ToolCallDelta(0, None, ', "days": 3}')]


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            '<|python_start|>[get_weather(city="Zürich"), get_time()]<|python_end|>',
            None,
            [ToolCall("get_weather", '{"city": "Z\\u00fcrich"}'), TIME],  # as vLLM: ASCII
        ),
        ("[get_time()]<|python_end|> Done.", " Done.", [TIME]),
        (" <|python_start|>[get_time()]", None, [TIME]),
        ("<|python_start|>Hello", "<|python_start|>Hello", []),
        ("<|python_sta", "<|python_sta", []),
    ],
)
def test_llama4_pythonic(text, content, calls):
    _check_streams(Llama4PythonicToolParser, text, content, calls)


# ---- qwen3_coder ----

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "hot": {"type": "boolean"},
        "tags": {"type": "array"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
}
QWEN_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
    '<parameter=hot>\nTrue\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n'
    "<parameter=note>\nnull\n</parameter>\n<parameter=other>\n7\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_ARGS = (
    '{"city": "Paris", "days": 3, "temp": 21.5, "hot": true, "tags": ["a", 1], '
    '"note": null, "other": "7"}'
)


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (QWEN_CALL, None, [ToolCall("get_weather", QWEN_ARGS)]),
        (
            "I'll look.\n\n" + QWEN_CALL + "\n<tool_call>\n<function=get_time>\n</function>\n"
            "</tool_call>",
            "I'll look.",
            [ToolCall("get_weather", QWEN_ARGS), TIME],
        ),
        # a multi-line string value keeps its inner newlines; a missing </tool_call> at the end
        (
            "<tool_call>\n<function=write>\n<parameter=text>\nline 1\n\nline 3\n</parameter>\n"
            "</function>",
            None,
            [ToolCall("write", '{"text": "line 1\\n\\nline 3"}')],
        ),
        ("Plain answer <tool_c", "Plain answer <tool_c", []),
    ],
)
def test_qwen3_coder(text, content, calls):
    make = functools.partial(Qwen3CoderToolParser, tools={"get_weather": WEATHER_SCHEMA})
    _check_streams(make, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',  # hermes JSON, not XML
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n",  # cut off
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
    ],
)
def test_qwen3_coder_malformed_stays_content(text):
    assert Qwen3CoderToolParser().extract("A " + text) == ("A " + text, [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_weather\n</tool_call>",  # the tag never closes
        "<tool_call>\n<function=get weather\nrest>\n</function>\n</tool_call>",
    ],
)
def test_qwen3_coder_streams_no_call_for_a_broken_name(text):
    """Streamed, a function tag whose name runs into a line break or another tag is content,
    as when read whole, not a call named up to a later tag's '>'."""
    for sizes in _chunkings():
        events = _streamed(Qwen3CoderToolParser(), "A " + text, sizes)
        assert not any(isinstance(e, ToolCallDelta) for e in events)
    assert Qwen3CoderToolParser().extract("A " + text) == ("A " + text, [])


def test_qwen3_coder_streams_string_values_as_they_come():
    parser = Qwen3CoderToolParser(tools={"write": {"properties": {"n": {"type": "integer"}}}})
    assert parser.feed("<tool_call>\n<function=write>\n<parameter=text>\nfirst") == [
        ToolCallDelta(0, "write", ""),
        ToolCallDelta(0, None, '{"text": "first'),
    ]
    # a newline that may be the format's is held until the next text shows it is not
    assert parser.feed(' "line"\n') == [ToolCallDelta(0, None, ' \\"line\\"')]
    assert parser.feed("second\n</param") == [ToolCallDelta(0, None, "\\nsecond")]
    assert parser.feed("eter>\n<parameter=n>\n4\n") == [ToolCallDelta(0, None, '"')]
    assert parser.feed("</parameter>\n</function>") == [ToolCallDelta(0, None, ', "n": 4}')]


@pytest.mark.parametrize(
    "text,schema,value",
    [
        ("5", {"type": "integer"}, 5),
        ("five", {"type": "integer"}, "five"),
        ("7.0", {"type": "number"}, 7),
        ("nan", {"type": "number"}, "nan"),
        ("FALSE", {"type": "boolean"}, False),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
        ("None", {"type": ["string", "null"]}, None),
        ("None", {"type": "string"}, "None"),
        ("null", {"type": "integer"}, None),
        ("[1, 2]", None, "[1, 2]"),  # not in the tool's schema: a string
    ],
)
def test_qwen3_coder_values_follow_the_schema(text, schema, value):
    assert convert_value(text, schema) == value


# ---- granite ----


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": '
            '[1, 2]}}, {"name": "get_time", "arguments": {}}]',
            None,
            [PARIS, TIME],
        ),
        (
            ' <tool_call> [{"name": "get_time", "arguments": {}}]',
            None,
            [TIME],
        ),
        ('[{"name": "get_time", "arguments": {}}]', None, [TIME]),
        # vLLM's rule: calls only at the start of the output
        (
            'Sure: <|tool_call|>[{"name": "get_time", "arguments": {}}]',
            'Sure: <|tool_call|>[{"name": "get_time", "arguments": {}}]',
            [],
        ),
        ("<|tool_ca", "<|tool_ca", []),
    ],
)
def test_granite(text, content, calls):
    _check_streams(GraniteToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '<|tool_call|>[{"name": "f", "arguments": {"a": }}]',
        "<|tool_call|>not a list",
        '<|tool_call|>[{"arguments": {}}]',
    ],
)
def test_granite_malformed_stays_content(text):
    assert GraniteToolParser().extract(text) == (text, [])


# ---- deepseek_v3 ----

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def _ds_call(name: str, arguments: str) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
        "<｜tool▁call▁end｜>"
    )


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            "Checking."
            + DS_BEGIN
            + _ds_call("get_weather", '{"city": "Paris", "days": [1, 2]}')
            + "\n"
            + _ds_call("get_time", "{}")
            + DS_END,
            "Checking.",
            [PARIS, TIME],
        ),
        # a fence inside a string is text; the block may lack its end
        (
            DS_BEGIN + _ds_call("f", '{"s": "```<｜tool▁call▁end｜>"}'),
            None,
            [ToolCall("f", '{"s": "```<｜tool▁call▁end｜>"}')],
        ),
        ("Just text.", "Just text.", []),
    ],
)
def test_deepseek_v3(text, content, calls):
    _check_streams(DeepSeekV3ToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    [
        DS_BEGIN + _ds_call("f", "{oops}") + DS_END,
        DS_BEGIN + _ds_call("f", "[1]") + DS_END,
        DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜>",
        DS_BEGIN + _ds_call("f", '{"a": 1')[:-30],  # cut off
    ],
)
def test_deepseek_v3_malformed_stays_content(text):
    assert DeepSeekV3ToolParser().extract("X " + text) == ("X " + text, [])


# ---- phi4_mini_json ----


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}},'
            ' {"name": "get_time", "parameters": {}}]',
            None,
            [PARIS, TIME],
        ),
        (
            'I will call it. functools[{"name": "get_time", "arguments": {}}]',
            "I will call it.",
            [TIME],
        ),
        ("No call: functional programming.", "No call: functional programming.", []),
    ],
)
def test_phi4_mini_json(text, content, calls):
    _check_streams(Phi4MiniJsonToolParser, text, content, calls)


@pytest.mark.parametrize(
    "text",
    ['functools[{"name": "f", "arguments": {"a": }}]', "functools{}", "functools[oops]"],
)
def test_phi4_mini_json_malformed_stays_content(text):
    assert Phi4MiniJsonToolParser().extract(text) == (text, [])


# ---- all of them ----

SAMPLES = {
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}',
    "pythonic": '[get_weather(city="Paris", days=[1, 2]), get_time()]',
    "qwen3_coder": QWEN_CALL,
    "granite": '<|tool_call|>[{"name": "get_time", "arguments": {"a": [1, "]"]}}]',
    "deepseek_v3": DS_BEGIN + _ds_call("get_time", '{"a": "}"}') + DS_END,
    "phi4_mini_json": 'functools[{"name": "get_time", "arguments": {"a": 1}}]',
    "llama4_pythonic": '<|python_start|>[get_time(a="x")]<|python_end|>',
}


def test_registered_with_vllm_names():
    assert {
        "mistral": MistralToolParser,
        "pythonic": PythonicToolParser,
        "qwen3_coder": Qwen3CoderToolParser,
        "granite": GraniteToolParser,
        "deepseek_v3": DeepSeekV3ToolParser,
        "phi4_mini_json": Phi4MiniJsonToolParser,
        "llama4_pythonic": Llama4PythonicToolParser,
    }.items() <= TOOL_PARSERS.items()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_no_output_raises(name):
    """Every cut of a call, and the call with characters dropped, swapped or doubled: read
    whole and streamed without an exception; whole, every call is valid JSON."""
    make = TOOL_PARSERS[name]
    text = SAMPLES[name]
    rng = random.Random(name)
    variants = [text[:k] for k in range(len(text))]
    for _ in range(150):
        chars = list(text)
        k = rng.randrange(len(chars))
        op = rng.choice(("drop", "swap", "double"))
        if op == "drop":
            del chars[k]
        elif op == "swap" and k + 1 < len(chars):
            chars[k], chars[k + 1] = chars[k + 1], chars[k]
        else:
            chars.insert(k, chars[k])
        variants.append("".join(chars))
    for variant in variants:
        out = make().extract(variant)
        for call in out.calls:
            assert isinstance(json.loads(call.arguments), dict), (variant, call)
        for sizes in _chunkings(len(variant)):
            _streamed(make(), variant, sizes)
