"""A base for parsers of formats with markers: the text not yet understood waits in a buffer
until enough of it has come to decide (a marker may arrive split over several deltas), and
each state's step consumes what it can from the front.

It also reads what several formats share: a JSON list of call objects
([{"name": ..., "arguments": {...}}, ...]) after a marker.
"""

from __future__ import annotations

from frontend.tool_parsers.json_scan import WHITESPACE
from frontend.tool_parsers.streamer import ToolCallParser, partial_suffix

# States every BufferedParser has; subclasses add their own (other strings).
REST = "rest"  # the rest of the output is content
LIST = "list"  # a JSON list of call objects opens next ('[')
ELEMENT = "element"  # a call object of the list
CALL = "call"  # inside a call object
AFTER = "after"  # after a call object of the list: ',' or ']'


class BufferedParser(ToolCallParser):
    """Subclasses implement _step_own for their own states (and may override _after_list)."""

    # The keys of a list's call objects that hold the arguments.
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, state: str, eager: bool = True) -> None:
        super().__init__(eager)
        self._state = state
        self._buf = ""  # text not consumed yet
        # Text read since the last content or call (markers, brackets): it opens the next
        # call's raw text, or returns to the content when no call follows.
        self._pending = ""

    def _consume(self, text: str) -> None:
        self._buf += text
        while self._buf and self._step():
            pass

    def _end_of_output(self) -> None:
        if self._call is not None:
            self._record(self._pending + self._buf)
        else:
            self._content(self._pending + self._buf)
        self._pending = self._buf = ""

    def _step(self) -> bool:
        """Consume from the buffer's front; False when more text is needed to go on."""
        state = self._state
        if state == REST:
            self._content(self._pending + self._buf)
            self._pending = self._buf = ""
            return False
        if state == LIST:
            if not self._skip_blank():
                return False
            if self._buf[0] != "[":
                return self._give_up()
            self._pending += self._eat(1)
            self._state = ELEMENT
            return True
        if state == ELEMENT:
            if not self._skip_blank():
                return False
            if self._buf[0] != "{":
                return self._give_up()
            self._begin_call(self._pending, self.argument_keys)
            self._pending = ""
            self._state = CALL
            return True
        if state == CALL:
            end = self._feed_call(self._buf, 0)
            self._eat(end)
            call = self._call
            assert call is not None
            if call.done or call.failed:
                self._state = AFTER if self._end_call() else REST
                return True
            return False
        if state == AFTER:
            if not self._skip_blank():
                return False
            c = self._buf[0]
            if c == ",":
                self._eat(1)
                self._pending = ""
                self._state = ELEMENT
            elif c == "]":
                self._eat(1)
                self._pending = ""
                self._after_list()
            else:
                self._state = REST
            return True
        return self._step_own(state)

    def _step_own(self, state: str) -> bool:
        """A subclass's state's step (as _step)."""
        raise NotImplementedError(state)

    def _after_list(self) -> None:
        """The list closed: by default the rest is content."""
        self._state = REST

    # ---- helpers for steps ----

    def _eat(self, n: int) -> str:
        """Remove and return the buffer's first n characters."""
        piece, self._buf = self._buf[:n], self._buf[n:]
        return piece

    def _skip_blank(self) -> bool:
        """Move the buffer's leading blank to pending; whether other text follows it."""
        body = self._buf.lstrip(WHITESPACE)
        self._pending += self._buf[: len(self._buf) - len(body)]
        self._buf = body
        return bool(body)

    def _match(self, literal: str) -> bool | None:
        """Whether the buffer starts with literal (then consumed into pending); None when the
        buffer is a shorter start of it (more text decides)."""
        if self._buf.startswith(literal):
            self._pending += self._eat(len(literal))
            return True
        return None if literal.startswith(self._buf) else False

    def _seek(self, markers: tuple[str, ...]) -> str | None:
        """Content up to the first of markers, which is consumed into pending and returned;
        None when no marker is in the buffer (its end may begin one: held)."""
        found = [(k, m) for m in markers if (k := self._buf.find(m)) >= 0]
        if found:
            k, marker = min(found)
            self._content(self._eat(k))
            self._pending = self._eat(len(marker))
            return marker
        keep = max(partial_suffix(self._buf, m) for m in markers)
        self._content(self._eat(len(self._buf) - keep))
        return None

    def _give_up(self) -> bool:
        """The text is not a call after all: it and the rest of the output are content."""
        self._state = REST
        return True

    def _fail_call(self) -> None:
        """The call's text does not fit the format: end it as malformed."""
        call = self._call
        assert call is not None
        call.failed = True
        self._record(self._pending)
        self._pending = ""
        self._end_call()
