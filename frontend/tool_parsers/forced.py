"""The outputs of tool_choice "required" and a named function, which a constraint shapes
(frontend.tool_parsers.tool_choice): read as calls the same way as a parser's."""

from __future__ import annotations

from frontend.tool_parsers.json_scan import WHITESPACE
from frontend.tool_parsers.sequence import CALL, CONTENT, FIRST_OWN_STATE, CallSequenceParser
from frontend.tool_parsers.streamer import ToolCallDelta, ToolCallParser


class NamedFunctionParser(ToolCallParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    def __init__(self, name: str, eager: bool = True) -> None:
        super().__init__(eager)
        self.name = name
        self._held_arguments = ""  # trailing whitespace, sent only when more follows
        self._sent = False

    def _consume(self, text: str) -> None:
        self._start()
        text = self._held_arguments + text
        if not self._sent:
            text = text.lstrip()
        body = text.rstrip()
        self._held_arguments = text[len(body) :]
        if body:
            self._out.append(ToolCallDelta(0, None, body))
            self._sent = True

    def _end_of_output(self) -> None:
        self._start()

    def _start(self) -> None:
        if self.num_calls == 0:
            self.num_calls = 1
            self._out.append(ToolCallDelta(0, self.name, ""))


# What RequiredParser expects next, besides a call or content.
_OPEN, _ELEMENT, _AFTER = FIRST_OWN_STATE, FIRST_OWN_STATE + 1, FIRST_OWN_STATE + 2


class RequiredParser(CallSequenceParser):
    """tool_choice "required": a JSON array of {"name": ..., "parameters": {...}} objects."""

    after_call = _AFTER

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_OPEN, eager)

    def _read_between(self, text: str, i: int) -> int:
        c = text[i]
        if c in WHITESPACE:
            return i + 1
        if self._state == _OPEN and c == "[":
            self._state = _ELEMENT
            return i + 1
        if self._state == _ELEMENT and c == "{":
            self._begin_call(argument_keys=("parameters",))
            self._state = CALL
            return i
        if self._state in (_ELEMENT, _AFTER) and c in ",]":
            self._state = _ELEMENT if c == "," else CONTENT
            return i + 1
        self._state = CONTENT
        return i
