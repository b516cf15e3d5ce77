"""Mistral tool calls (vLLM's mistral parser), after any content: [TOOL_CALLS] then either a
JSON list of {"name", "arguments"} objects (tokenizers before v11) or name[ARGS]{...}, one
[TOOL_CALLS] per call (v11 and later; a name followed directly by its object is read too).
Call ids are 9 letters and digits, as Mistral's templates and tokenizers require."""

from __future__ import annotations

import random
import re
import string

from frontend.tool_parsers.buffered import LIST, REST, BufferedParser
from frontend.tool_parsers.json_scan import ArgumentsScanner

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")

# States: content up to [TOOL_CALLS]; after it (a list or a name); the name's end; the
# arguments; after a v11 call (another [TOOL_CALLS] or the end).
_SEEK, _BOT, _NAME_END, _ARGUMENTS, _NEXT = "seek", "bot", "name_end", "arguments", "next"


class MistralToolParser(BufferedParser):
    """Both of Mistral's formats; the text after the calls is content."""

    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens
    argument_keys = ("arguments",)

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_SEEK, eager)
        self._name = ""

    @staticmethod
    def call_id() -> str:
        """9 letters and digits (mistral_common's validator refuses other ids)."""
        return "".join(random.choices(_ID_CHARS, k=9))

    def _step_own(self, state: str) -> bool:
        if state == _SEEK:
            if self._seek((BOT,)) is None:
                return False
            self._state = _BOT
            return True
        if state == _BOT:
            if not self._skip_blank():
                return False
            if self._buf[0] == "[":
                self._state = LIST
                return True
            name = _NAME.match(self._buf)
            assert name is not None
            if name.end() == len(self._buf):
                return False  # the name may go on
            if not name.group():
                return self._give_up()
            self._name = name.group()
            self._pending += self._eat(name.end())
            self._state = _NAME_END
            return True
        if state == _NAME_END:
            matched = self._match(ARGS)
            if matched is None:
                return False
            if not matched and self._buf[0] != "{":
                return self._give_up()
            self._begin_call(self._pending, scanner=ArgumentsScanner(self._name))
            self._pending = ""
            self._state = _ARGUMENTS
            return True
        if state == _ARGUMENTS:
            self._eat(self._feed_call(self._buf, 0))
            call = self._call
            assert call is not None
            if call.done or call.failed:
                self._state = _NEXT if self._end_call() else REST
                return True
            return False
        # _NEXT: another call, or the rest is content
        if not self._skip_blank():
            return False
        matched = self._match(BOT)
        if matched is None:
            return False
        if matched:
            self._pending = ""
            self._state = _BOT
            return True
        return self._give_up()
