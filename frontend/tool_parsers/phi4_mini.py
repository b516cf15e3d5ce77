"""Phi-4-mini's JSON tool calls (vLLM's phi4_mini_json): functools[{"name": ..., "arguments":
{...}}, ...] ("parameters" is read too), after any content."""

from __future__ import annotations

from frontend.tool_parsers.buffered import LIST, BufferedParser

MARKER = "functools"
_SEEK = "seek"  # content, up to the marker


class Phi4MiniJsonToolParser(BufferedParser):
    """Content, then functools and a JSON list of calls; what follows the list is content."""

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_SEEK, eager)

    def _step_own(self, state: str) -> bool:
        if self._seek((MARKER,)) is None:
            return False
        self._state = LIST
        return True
