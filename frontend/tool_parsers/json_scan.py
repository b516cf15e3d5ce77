"""Incremental scanning of JSON as a model writes it: where one value ends, and a tool call
object's name and raw arguments text, from text that arrives a few characters at a time.

The scanners track strings and nesting only; whether the text is valid JSON is checked with
json.loads once a value is complete (CallObjectScanner.valid).
"""

from __future__ import annotations

import json
import re

WHITESPACE = " \t\r\n"

_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[\s,}\]:]")


class JsonValueScanner:
    """Finds the end of one JSON value (object, array, string or scalar) fed in pieces.

    The first character fed must be the value's first; a scalar (number, true, false, null)
    ends at the next delimiter, which is not consumed.
    """

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self._started = False
        self._depth = 0
        self._string = False
        self._escape = False
        self._scalar = False

    def feed(self, text: str, pos: int = 0) -> int:
        """Consume text[pos:] up to the value's end; the index after the last consumed char."""
        i, n = pos, len(text)
        while i < n and not self.done:
            if self._escape:
                self._escape = False
                i += 1
            elif self._string:
                m = _STRING_STOP.search(text, i)
                if m is None:
                    return n
                i = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self._string = False
                    self.done = self._depth == 0
            elif self._scalar:
                m = _SCALAR_END.search(text, i)
                if m is None:
                    return n
                self.done = True
                return m.start()
            elif not self._started:
                self._started = True
                c = text[i]
                if c in "}],:" or c in WHITESPACE:
                    self.failed = self.done = True
                    return i
                if c == '"':
                    self._string = True
                    i += 1
                elif c in "{[":
                    self._depth = 1
                    i += 1
                else:
                    self._scalar = True
            else:
                m = _CONTAINER_STOP.search(text, i)
                if m is None:
                    return n
                i = m.end()
                c = m.group()
                if c == '"':
                    self._string = True
                elif c in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    self.done = self._depth == 0
        return i

    @property
    def in_string(self) -> bool:
        """The text so far ends inside a string."""
        return self._string


# CallObjectScanner states: what the next non-blank character must be.
_OPEN, _KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _COMMA = range(7)


class CallObjectScanner:
    """One tool call written as a JSON object, {"name": "f", "arguments": {...}} (keys in any
    order; other keys ignored), fed in pieces.

    feed() returns the raw text of the arguments value as it grows (a JSON string value is
    returned decoded, once complete); name is set once its string is complete. An object
    without arguments has "{}".
    """

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.name: str | None = None
        self.done = False  # the object closed
        self.failed = False  # the text is not such an object
        self._argument_keys = argument_keys
        self._state = _OPEN
        self._key = ""
        self._value: JsonValueScanner | None = None
        self._raw: list[str] = []  # the key or value being read (arguments: all of them)
        self._arguments: str | None = None  # complete arguments text
        self._in_arguments = False
        self._string_arguments = False

    @property
    def in_string(self) -> bool:
        """The text so far ends inside a string (a key or a value)."""
        return (
            self._value is not None
            and self._state in (_IN_KEY, _IN_VALUE)
            and self._value.in_string
        )

    @property
    def valid(self) -> bool:
        """The object closed, with a string name and arguments that are valid JSON."""
        if not self.done or self.failed or self.name is None:
            return False
        try:
            json.loads(self._arguments if self._arguments is not None else "{}")
        except ValueError:
            return False
        return True

    def feed(self, text: str, pos: int = 0) -> tuple[int, str]:
        """Consume text[pos:] up to the object's end: (the index after it, new arguments text)."""
        out: list[str] = []
        i, n = pos, len(text)
        while i < n and not (self.done or self.failed):
            if self._state in (_IN_KEY, _IN_VALUE):
                i = self._feed_value(text, i, out)
                continue
            c = text[i]
            if c in WHITESPACE:
                i += 1
                continue
            if self._state == _OPEN:
                self._expect(c == "{", _KEY)
            elif self._state == _KEY and c == "}":
                self._close(out)
            elif self._state == _KEY:
                self._start(c == '"', _IN_KEY)
                continue  # the value scanner reads the quote
            elif self._state == _COLON:
                self._expect(c == ":", _VALUE)
            elif self._state == _VALUE:
                self._start_value(c)
                continue
            elif c == "}":
                self._close(out)
            else:
                self._expect(c == ",", _KEY)
            i += 1
        return i, "".join(out)

    def _expect(self, ok: bool, state: int) -> None:
        if ok:
            self._state = state
        else:
            self.failed = True

    def _start(self, ok: bool, state: int) -> None:
        self._expect(ok, state)
        self._value = JsonValueScanner()
        self._raw = []

    def _start_value(self, first: str) -> None:
        self._start(True, _IN_VALUE)
        self._in_arguments = self._key in self._argument_keys and self._arguments is None
        self._string_arguments = self._in_arguments and first == '"'

    def _feed_value(self, text: str, i: int, out: list[str]) -> int:
        value = self._value
        assert value is not None
        j = value.feed(text, i)
        piece = text[i:j]
        self._raw.append(piece)
        if self._in_arguments and not self._string_arguments:
            out.append(piece)
        if value.failed:
            self.failed = True
        elif value.done:
            self._value_done(out)
        return j

    def _value_done(self, out: list[str]) -> None:
        raw = "".join(self._raw)
        if self._state == _IN_KEY:
            key = _loads(raw)
            self._key = key if isinstance(key, str) else ""
            self.failed = not isinstance(key, str)
            self._state = _COLON
            return
        self._state = _COMMA
        if self._in_arguments:
            self._arguments = raw
            if self._string_arguments:
                decoded = _loads(raw)
                self._arguments = decoded if isinstance(decoded, str) else None
                self.failed = self._arguments is None
                out.append(self._arguments or "")
        elif self._key == "name":
            name = _loads(raw)
            if isinstance(name, str):
                self.name = name
            else:
                self.failed = True
        self._in_arguments = False

    def _close(self, out: list[str]) -> None:
        self.done = True
        if self._arguments is None:
            self._arguments = "{}"
            out.append("{}")


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


class ArgumentsScanner:
    """A call whose name the format gives before its arguments (Mistral's name[ARGS]{...},
    DeepSeek's fenced JSON): its arguments, one JSON object, fed in pieces after any blank.

    feed() returns the raw text of the object as it grows; valid once it closed as a JSON object.
    A parser may set failed when the text around the object does not fit its format.
    """

    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.done = False
        self.failed = False
        self._value: JsonValueScanner | None = None
        self._raw: list[str] = []

    @property
    def in_string(self) -> bool:
        """The text so far ends inside a string of the arguments."""
        return self._value is not None and not self.done and self._value.in_string

    @property
    def valid(self) -> bool:
        """The arguments closed and are a JSON object."""
        if not self.done or self.failed:
            return False
        return isinstance(_loads("".join(self._raw)), dict)

    def feed(self, text: str, pos: int = 0) -> tuple[int, str]:
        """Consume text[pos:] up to the object's end: (the index after it, new arguments text)."""
        i, n = pos, len(text)
        if self._value is None:
            while i < n and text[i] in WHITESPACE:
                i += 1
            if i == n or self.done or self.failed:
                return i, ""
            if text[i] != "{":
                self.failed = True
                return i, ""
            self._value = JsonValueScanner()
        if self.done or self.failed:
            return i, ""
        end = self._value.feed(text, i)
        piece = text[i:end]
        self._raw.append(piece)
        self.done = self._value.done
        return end, piece
