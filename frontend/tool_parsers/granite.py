"""Granite 3.x tool calls (vLLM's granite parser): the output is <|tool_call|> (Granite 3.0's
special token) or <tool_call> (3.1's text), then a JSON list of {"name", "arguments"}
objects. An output that does not start so is content."""

from __future__ import annotations

from frontend.tool_parsers.buffered import LIST, BufferedParser

MARKERS = ("<|tool_call|>", "<tool_call>")
_START = "start"  # blank, then a marker or the list's '['


class GraniteToolParser(BufferedParser):
    """A JSON list of calls at the start of the output, after an optional marker."""

    needs_special_tokens = True  # <|tool_call|> is a special token

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_START, eager)

    def _step_own(self, state: str) -> bool:
        if not self._skip_blank():
            return False
        if self._buf[0] == "[":
            self._state = LIST
            return True
        for marker in MARKERS:
            matched = self._match(marker)
            if matched:
                self._state = LIST
                return True
            if matched is None:
                return False
        return self._give_up()
