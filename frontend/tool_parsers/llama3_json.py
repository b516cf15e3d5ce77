"""Llama 3.x JSON tool calls: the output is {"name": "f", "parameters": {...}} ("arguments" is
read too), possibly after <|python_tag|>, several separated by ';'. An output that does not
start with a call is content."""

from __future__ import annotations

from frontend.tool_parsers.json_scan import WHITESPACE
from frontend.tool_parsers.sequence import CALL, CONTENT, FIRST_OWN_STATE, CallSequenceParser

PYTHON_TAG = "<|python_tag|>"

# What the parser expects next, besides a call or content.
_START, _SEPARATOR = FIRST_OWN_STATE, FIRST_OWN_STATE + 1


class Llama3JsonToolParser(CallSequenceParser):
    """JSON call objects from the start of the output; what follows the last is content."""

    after_call = _SEPARATOR

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_START, eager)
        self._prefix = ""  # <|python_tag|>, or the start of it, read before the first call

    def _read_between(self, text: str, i: int) -> int:
        c = text[i]
        partial_tag = 0 < len(self._prefix) < len(PYTHON_TAG)
        if (
            partial_tag
            and PYTHON_TAG.startswith(self._prefix + c)
            or self._prefix.startswith(PYTHON_TAG)
            and c in WHITESPACE
        ):
            self._prefix += c
        elif c in WHITESPACE and not self._prefix:
            self._content(c)  # held: dropped before a call
        elif self._state == _SEPARATOR:
            self._state = _START if c == ";" else CONTENT
            return i + (c == ";")
        elif c == "<" and self.num_calls == 0 and not self._prefix:
            self._prefix = "<"
        elif c == "{" and not partial_tag:
            self._begin_call(self._prefix)
            self._prefix = ""
            self._state = CALL
            return i
        else:
            self._content(self._prefix)
            self._prefix = ""
            self._state = CONTENT
            return i
        return i + 1

    def _end_of_output(self) -> None:
        self._content(self._prefix)
        self._prefix = ""
