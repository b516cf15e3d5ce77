"""Each new tool parser fed what its model family's own chat template writes (the templates in
tests/api/tool_templates/, sources in its README): a conversation with tools and an earlier
assistant tool call is rendered through the server's apply_chat_template with the default
model's tokenizer (the template swapped in), and the assistant turn the template wrote parses
back to the same calls, whole and streamed in pieces of every size."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from config.default_model import resolve_model_path
from frontend.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from frontend.tool_parsers.granite import GraniteToolParser
from frontend.tool_parsers.mistral import MistralToolParser
from frontend.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from frontend.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from frontend.tool_parsers.streamer import ToolCall, collect
from tests.api.test_tool_calling_parsers import _chunkings, _streamed
from tokenizer_proc.tokenizer import apply_chat_template, load_tokenizer

TEMPLATES = Path(__file__).parent / "tool_templates"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "days": {"type": "integer", "description": "how many days"},
        "hourly": {"type": "boolean", "description": "hour by hour"},
        "fields": {"type": "array", "description": "what to report"},
    },
    "required": ["city"],
}
TIME = {
    "type": "object",
    "properties": {"offset": {"type": "number", "description": "hours from UTC"}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# The earlier calls: (name, arguments).
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "hourly": True, "fields": ["rain", "wind"]}),
    ("get_time", {"offset": 5.5}),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def _conversation(calls, call_id=lambda i: f"call{i:06d}abc", content=None) -> list[dict]:
    """A user turn, the assistant's calls (OpenAI's shape: arguments as JSON text), the tools'
    results."""
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": call_id(i),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for i, (name, arguments) in enumerate(calls)
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": call_id(i), "content": '{"ok": true}'}
        for i in range(len(calls))
    ]
    return [{"role": "user", "content": "Weather in Paris, and the time?"}, assistant, *results]


def _render(tokenizer, template: str, messages: list[dict]) -> str:
    """The prompt text as the server renders it (its token ids, decoded)."""
    text = (TEMPLATES / template).read_text()
    ids = apply_chat_template(tokenizer, messages, False, chat_template=text, tools=TOOLS)
    return tokenizer.decode(ids)


def _between(text: str, start: str, end: str, include_start: bool = False) -> str:
    i = text.index(start)
    j = text.index(end, i + len(start))
    return text[i if include_start else i + len(start) : j]


def _check_reads_back(make, output: str, calls, content=None) -> None:
    """The output parses to calls (name, arguments as data), whole and streamed alike."""
    extracted = make().extract(output)
    assert extracted.content == content, output
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls, output
    for sizes in _chunkings():
        events = _streamed(make(), output, sizes)
        assert collect(events) == extracted


def test_mistral_parallel_template(tokenizer):
    prompt = _render(
        tokenizer,
        "tool_chat_template_mistral_parallel.jinja",
        _conversation(CALLS, call_id=lambda i: MistralToolParser.call_id()),
    )
    assert "[AVAILABLE_TOOLS]" in prompt and '"name": "get_weather"' in prompt
    # the template accepts the parser's 9-character ids and writes the calls as a JSON list
    output = _between(prompt, "[TOOL_CALLS]", tokenizer.eos_token, include_start=True)
    assert output.startswith("[TOOL_CALLS] [{")
    _check_reads_back(MistralToolParser, output, CALLS)


def test_llama32_pythonic_template(tokenizer):
    # The template writes values with Python's %s: numbers, booleans and lists of them are
    # literals again; strings lose their quotes (next test).
    calls = [("get_weather", {"days": 3, "hourly": True, "fields": [1, 2]}), ("get_time", {})]
    prompt = _render(tokenizer, "tool_chat_template_llama3.2_pythonic.jinja", _conversation(calls))
    assert "respond with a python list of the calls" in prompt
    output = _between(prompt, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert output == "[get_weather(days=3, hourly=True, fields=[1, 2]), get_time()]"
    _check_reads_back(PythonicToolParser, output, calls)


def test_llama32_pythonic_template_unquoted_strings_stay_content(tokenizer):
    prompt = _render(
        tokenizer, "tool_chat_template_llama3.2_pythonic.jinja", _conversation([CALLS[0]])
    )
    output = _between(prompt, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert output.startswith("[get_weather(city=Paris, ")  # a name, not a string
    assert PythonicToolParser().extract(output) == (output, [])


def test_llama4_pythonic_template(tokenizer):
    # Llama 4's template quotes every value: strings read back as written (numbers would come
    # back as strings: the template's, not the parser's, choice).
    calls = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    prompt = _render(tokenizer, "tool_chat_template_llama4_pythonic.jinja", _conversation(calls))
    assert "Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]" in prompt
    output = _between(prompt, "<|header_start|>assistant<|header_end|>\n\n", "<|eot|>")
    assert output == '[get_weather(city="Paris", unit="C"), get_time(zone="CET")]'
    _check_reads_back(PythonicToolParser, output, calls)
    _check_reads_back(Llama4PythonicToolParser, output, calls)
    # Llama 4 may wrap its list in <|python_start|> ... <|python_end|> (vLLM's llama4_pythonic)
    wrapped = "<|python_start|>" + output + "<|python_end|>"
    _check_reads_back(Llama4PythonicToolParser, wrapped, calls)


def test_qwen3coder_template(tokenizer):
    prompt = _render(tokenizer, "tool_chat_template_qwen3coder.jinja", _conversation(CALLS))
    assert "<function=example_function_name>" in prompt and "<name>get_weather</name>" in prompt
    output = _between(prompt, "<|im_start|>assistant", "<|im_end|>")
    assert "<parameter=hourly>\nTrue\n</parameter>" in output  # Jinja's string of a boolean
    _check_reads_back(functools.partial(Qwen3CoderToolParser, tools=SCHEMAS), output, CALLS)


def test_qwen3coder_template_keeps_content_before_the_calls(tokenizer):
    messages = _conversation(CALLS, content="Let me look that up.")
    prompt = _render(tokenizer, "tool_chat_template_qwen3coder.jinja", messages)
    output = _between(prompt, "<|im_start|>assistant", "<|im_end|>")
    _check_reads_back(
        functools.partial(Qwen3CoderToolParser, tools=SCHEMAS),
        output,
        CALLS,
        content="\nLet me look that up.",
    )


def test_deepseekv3_template(tokenizer):
    prompt = _render(tokenizer, "tool_chat_template_deepseekv3.jinja", _conversation(CALLS))
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜><function_name>\n```json" in prompt
    output = _between(prompt, "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
    # (the template's own indentation comes before and between the calls)
    assert output.lstrip(" ").startswith("<｜tool▁calls▁begin｜>")
    _check_reads_back(DeepSeekV3ToolParser, output, CALLS)


def test_deepseekv3_template_with_content(tokenizer):
    messages = _conversation(CALLS, content="Checking.")
    prompt = _render(tokenizer, "tool_chat_template_deepseekv3.jinja", messages)
    # (the template's indentation before the turn is no part of what a model writes)
    output = _between(prompt, "<｜Assistant｜>", "<｜end▁of▁sentence｜>").lstrip(" ")
    _check_reads_back(DeepSeekV3ToolParser, output, CALLS, content="Checking.")


def _raw_answer(prefix: str, calls) -> str:
    """An answer as the model wrote it: prefix and a JSON list of the calls."""
    return prefix + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def test_granite_template(tokenizer):
    # Granite 3.3's template renders an assistant turn's content only (not tool_calls): an
    # earlier call goes back as the text the model wrote, which must read back.
    answer = _raw_answer("<|tool_call|>", CALLS)
    messages = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": answer},
    ]
    prompt = _render(tokenizer, "ibm-granite-granite-3.3-2B-Instruct.jinja", messages)
    assert "respond only with <|tool_call|> followed by a JSON list of tools used" in prompt
    output = _between(prompt, "<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>")
    assert output == answer
    _check_reads_back(GraniteToolParser, output, CALLS)


def test_phi4_mini_template(tokenizer):
    # The template asks for functools[...] and renders an earlier answer's content as written.
    answer = _raw_answer("functools", CALLS)
    messages = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": answer},
    ]
    prompt = _render(tokenizer, "tool_chat_template_phi4_mini.jinja", messages)
    assert (
        'functools[{"name": [function name], "arguments": [function arguments as JSON]}, ...]'
        in prompt
    )
    output = _between(prompt, "<|assistant|>", "<|end|>")
    assert output == answer
    _check_reads_back(Phi4MiniJsonToolParser, output, CALLS)


def test_phi4_mini_template_tool_calls_history_is_not_json(tokenizer):
    # Its tool_calls branch writes the arguments object with Jinja's str() (Python's repr,
    # single quotes) and no functools marker: not the format the model is asked for, so read
    # back it is content, not a call (vLLM's template; documented in docs/serve.md).
    prompt = _render(tokenizer, "tool_chat_template_phi4_mini.jinja", _conversation([CALLS[1]]))
    output = _between(prompt, "<|assistant|>", "<|end|>")
    assert output == '{"name": "get_time", "arguments": {\'offset\': 5.5}}'
    assert Phi4MiniJsonToolParser().extract("functools[" + output + "]").calls == []


def test_round_trip_of_what_the_parser_returns(tokenizer):
    """A call the parser read goes back into the history (OpenAI's shape) and renders to the
    same call again (DeepSeek-V3's template; arguments as the parser returned them)."""
    output = _between(
        _render(tokenizer, "tool_chat_template_deepseekv3.jinja", _conversation(CALLS)),
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
    )
    calls = DeepSeekV3ToolParser().extract(output).calls
    again = [(c.name, json.loads(c.arguments)) for c in calls]
    prompt = _render(tokenizer, "tool_chat_template_deepseekv3.jinja", _conversation(again))
    output_again = _between(prompt, "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
    assert output_again == output
    assert (
        DeepSeekV3ToolParser().extract(output_again).calls
        == calls
        == [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in CALLS]
    )
