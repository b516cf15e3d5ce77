"""Pythonic tool calls (vLLM's pythonic parser; Llama 3.2 and 4, ToolACE): the output is a
Python list of calls, [get_weather(city="Paris"), f(x=1)], keyword arguments with literal
values, read with Python's ast (never evaluated). An output that does not start with '[' is
content. Arguments are sent as JSON (json.dumps of the literal values), one argument at a time
as each value completes."""

from __future__ import annotations

import json
import re

from frontend.tool_parsers.buffered import REST, BufferedParser
from frontend.tool_parsers.json_scan import ArgumentsScanner
from frontend.tool_parsers.python_literals import NotALiteral, expression_end, literal_value

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# States: the list's '['; a call's name and '('; an argument's keyword and '=' (or the ')');
# its value; after a call (',' or ']').
_START, _CALL, _KEYWORD = "start", "call_name", "keyword"
_VALUE, _AFTER_CALL, _END = "value", "after_call", "end"


class PythonicToolParser(BufferedParser):
    """A list of calls from the start of the output; what follows the list is content."""

    # Tokens a model may write around the list (Llama 4's), dropped: (before, after).
    wrappers: tuple[str, str] | None = None
    ensure_ascii = False  # how json.dumps writes the arguments (vLLM's choice per parser)

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_START, eager)
        self._arguments = 0  # the current call's arguments so far
        self._keyword = ""  # the argument whose value is being read

    def _step_own(self, state: str) -> bool:
        if not self._skip_blank():
            return False
        c = self._buf[0]
        if state == _START:
            if self.wrappers is not None and c == "<" and self.wrappers[0] not in self._pending:
                matched = self._match(self.wrappers[0])
                if matched is None:
                    return False
                if matched:
                    return True
            if c != "[":
                return self._give_up()
            self._pending += self._eat(1)
            self._state = _CALL
            return True
        if state == _CALL:
            return self._read_call_name()
        if state == _KEYWORD:
            return self._read_keyword()
        if state == _VALUE:
            return self._read_value()
        # _AFTER_CALL
        if c in ",]":
            self._eat(1)
            self._pending = ""
            self._state = _CALL if c == "," else _END
            return True
        if state == _END:
            matched = self.wrappers is not None and self._match(self.wrappers[1])
            if matched is None:
                return False
            if matched:
                self._pending = ""  # the closing token is no content
        return self._give_up()

    def _read_call_name(self) -> bool:
        name = _IDENTIFIER.match(self._buf)
        if name is None:
            return self._give_up()
        rest = self._buf[name.end() :].lstrip()
        if not rest:
            return False  # the name may go on
        if rest[0] != "(":
            return self._give_up()
        end = len(self._buf) - len(rest) + 1
        self._begin_call(self._pending + self._eat(end), scanner=ArgumentsScanner(name.group()))
        self._pending = ""
        self._feed_call("", 0)  # the name is known: send it
        self._arguments = 0
        self._state = _KEYWORD
        return True

    def _read_keyword(self) -> bool:
        if self._buf[0] == ")":
            self._record(self._pending + self._eat(1))
            self._pending = ""
            self._feed_call("{}" if self._arguments == 0 else "}", 0, record=False)
            self._state = _AFTER_CALL if self._end_call() else REST
            return True
        keyword = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=?)", self._buf)
        if keyword is None:
            self._fail()
            return True
        if keyword.end() == len(self._buf):
            return False  # the keyword or its '=' may go on
        if not keyword.group(2):
            self._fail()
            return True
        self._record(self._pending + self._eat(keyword.end()))
        self._pending = ""
        self._keyword = keyword.group(1)
        self._state = _VALUE
        return True

    def _read_value(self) -> bool:
        end = expression_end(self._buf)
        if end is None:
            return False
        source = self._eat(end)
        self._record(self._pending + source)
        self._pending = ""
        try:
            value = literal_value(source)
        except NotALiteral:
            self._fail()
            return True
        prefix = "{" if self._arguments == 0 else ", "
        self._arguments += 1
        ascii_only = self.ensure_ascii
        piece = f"{prefix}{json.dumps(self._keyword, ensure_ascii=ascii_only)}: "
        self._feed_call(piece + json.dumps(value, ensure_ascii=ascii_only), 0, record=False)
        if self._buf[0] == ",":
            self._record(self._eat(1))
        self._state = _KEYWORD
        return True

    def _fail(self) -> None:
        self._fail_call()
        self._state = REST


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's llama4_pythonic: the same list, which Llama 4 may wrap in <|python_start|> and
    <|python_end|>; arguments JSON with non-ASCII escaped, as vLLM writes them."""

    needs_special_tokens = True  # the wrappers are special tokens
    wrappers = ("<|python_start|>", "<|python_end|>")
    ensure_ascii = True
