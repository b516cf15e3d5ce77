"""Qwen3-Coder's XML tool calls (vLLM's qwen3_coder parser), with content around them:

<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call>

Values are plain text (one newline after the opening tag and one before the closing tag are
the format's), turned into JSON by the parameter's type in the tool's schema
(frontend.tool_parsers.schema_values). Arguments are sent one parameter at a time, a string
value as it is written (long values, such as a file's text, stream)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from frontend.tool_parsers.buffered import BufferedParser
from frontend.tool_parsers.json_scan import ArgumentsScanner
from frontend.tool_parsers.schema_values import convert_value, is_plain_string
from frontend.tool_parsers.streamer import partial_suffix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

# States: content up to <tool_call>; <function=NAME>; a parameter or </function>; a value;
# </tool_call>.
_SEEK, _FUNCTION, _PARAMETERS, _VALUE, _CLOSE = "seek", "function", "parameters", "value", "close"


class Qwen3CoderToolParser(BufferedParser):
    """Calls in <tool_call> tags anywhere in the output; text outside them is content."""

    needs_special_tokens = True  # <tool_call> is a special token of Qwen's tokenizers
    uses_tool_schemas = True

    def __init__(self, eager: bool = True, tools: dict[str, Any] | None = None) -> None:
        super().__init__(_SEEK, eager)
        self.tools = tools or {}  # function name -> its parameters' JSON schema
        self._properties: dict[str, Any] = {}
        self._parameter = ""
        self._text_started = False  # a plain string value's opening quote was sent
        self._arguments = 0

    def _step_own(self, state: str) -> bool:
        if state == _SEEK:
            if self._seek((CALL_START,)) is None:
                return False
            self._state = _FUNCTION
            return True
        if state == _VALUE:
            return self._read_value()
        if not self._skip_blank():
            return False
        if state == _FUNCTION:
            return self._read_tag(FUNCTION, self._begin_function)
        if state == _PARAMETERS:
            matched = self._match(FUNCTION_END)
            if matched is None:
                return False
            if matched:
                self._record(self._pending)
                self._pending = ""
                self._send("{}" if self._arguments == 0 else "}")
                self._state = _CLOSE
                return True
            return self._read_tag(PARAMETER, self._begin_parameter)
        # _CLOSE: </tool_call> (when other text comes, the call ended without it)
        matched = self._match(CALL_END)
        if matched is None:
            return False
        blank, self._pending = self._pending, ""
        if matched:
            self._record(blank)
        self._end_call()
        if not matched:
            self._content(blank)
        self._state = _SEEK
        return True

    def _read_tag(self, prefix: str, then: Callable[[str, str], None]) -> bool:
        """<prefix NAME>: then(NAME, the tag's text) once the tag is complete."""
        if not self._buf.startswith(prefix):
            return False if prefix.startswith(self._buf) else self._malformed()
        end = self._buf.find(">", len(prefix))
        # A name never holds a tag or a line break: cut there, the tag is malformed (not a call
        # named up to a later tag's '>').
        raw = self._buf[len(prefix) : end if end >= 0 else len(self._buf)]
        if "<" in raw or "\n" in raw.strip():
            return self._malformed()
        if end < 0:
            return False  # the name may go on
        name = raw.strip()
        if not name:
            return self._malformed()
        tag = self._eat(end + 1)
        then(name, tag)
        return True

    def _begin_function(self, name: str, tag: str) -> None:
        self._begin_call(self._pending + tag, scanner=ArgumentsScanner(name))
        self._pending = ""
        self._feed_call("", 0)  # the name is known: send it
        schema = self.tools.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        self._properties = properties if isinstance(properties, dict) else {}
        self._arguments = 0
        self._state = _PARAMETERS

    def _begin_parameter(self, name: str, tag: str) -> None:
        self._record(self._pending + tag)
        self._pending = ""
        self._parameter = name
        self._text_started = False
        self._state = _VALUE

    def _read_value(self) -> bool:
        """A parameter's value up to </parameter>; a plain string is sent as it comes."""
        schema = self._properties.get(self._parameter)
        end = self._buf.find(PARAMETER_END)
        if is_plain_string(schema):
            return self._read_text(end)
        if end < 0:
            return False
        text = self._eat(end)
        self._record(text + self._eat(len(PARAMETER_END)))
        text = text.removeprefix("\n").removesuffix("\n")
        self._send(self._key() + json.dumps(convert_value(text, schema), ensure_ascii=False))
        self._state = _PARAMETERS
        return True

    def _read_text(self, end: int) -> bool:
        """A string value, escaped into the arguments piece by piece: the format's newline
        after the tag is dropped, and text that may be the newline before </parameter> (or
        the start of the tag) is held until it is known."""
        if not self._text_started:
            self._text_started = True
            self._record(self._eat(1) if self._buf.startswith("\n") else "")
            self._send(self._key() + '"')
            return bool(self._buf)
        if end >= 0:
            text = self._eat(end)
            self._record(text + self._eat(len(PARAMETER_END)))
            self._send(json.dumps(text.removesuffix("\n"), ensure_ascii=False)[1:])
            self._state = _PARAMETERS
            return True
        keep = max(
            partial_suffix(self._buf, "\n" + PARAMETER_END),
            partial_suffix(self._buf, PARAMETER_END),
        )
        text = self._eat(len(self._buf) - keep)
        if text:
            self._record(text)
            self._send(json.dumps(text, ensure_ascii=False)[1:-1])
        return False

    def _key(self) -> str:
        """The arguments' text before the parameter's value."""
        prefix = "{" if self._arguments == 0 else ", "
        self._arguments += 1
        return f"{prefix}{json.dumps(self._parameter, ensure_ascii=False)}: "

    def _send(self, arguments: str) -> None:
        self._feed_call(arguments, 0, record=False)

    def _malformed(self) -> bool:
        """Text that does not fit: a started call ends malformed; then content again."""
        if self._call is not None:
            self._fail_call()
        else:
            self._content(self._pending)
            self._pending = ""
        self._state = _SEEK
        return True
