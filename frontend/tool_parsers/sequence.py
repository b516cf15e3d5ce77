"""Parsers of calls written one after another as JSON objects (Llama 3's JSON, the array of
tool_choice "required"): the objects are read here, the text between them by a subclass."""

from __future__ import annotations

from frontend.tool_parsers.streamer import ToolCallParser

# States every CallSequenceParser has; subclasses number their own from FIRST_OWN_STATE.
CONTENT, CALL, FIRST_OWN_STATE = 0, 1, 2


class CallSequenceParser(ToolCallParser):
    """Reads call objects (state CALL) and what a subclass's _read_between reads between them;
    once a call fails or other text comes (state CONTENT), the rest of the output is content."""

    # The state after a complete call.
    after_call = CONTENT

    def __init__(self, state: int, eager: bool = True) -> None:
        super().__init__(eager)
        self._state = state

    def _consume(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            if self._state == CONTENT:
                self._content(text[i:])
                return
            if self._state == CALL:
                i = self._feed_call(text, i)
                assert self._call is not None
                if self._call.done or self._call.failed:
                    self._state = self.after_call if self._end_call() else CONTENT
            else:
                i = self._read_between(text, i)

    def _read_between(self, text: str, i: int) -> int:
        """Read text[i:] in the subclass's own state; the index after what it consumed (it
        moves to CALL before a call's '{', which the call then reads)."""
        raise NotImplementedError
