"""DeepSeek-V3 tool calls (vLLM's deepseek_v3 parser), after any content:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json
{...}
```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>"""

from __future__ import annotations

from frontend.tool_parsers.buffered import REST, BufferedParser
from frontend.tool_parsers.json_scan import ArgumentsScanner

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"

# States: content up to the calls; between calls; the call's type (up to SEP); its name (up
# to the line's end); the fence; the arguments; the closing fence and CALL_END.
_SEEK, _BETWEEN, _TYPE, _NAME = "seek", "between", "type", "name"
_FENCE, _ARGUMENTS, _CLOSE, _CALL_END = "fence", "arguments", "close", "call_end"


class DeepSeekV3ToolParser(BufferedParser):
    """The calls block after the content; what follows it is content."""

    needs_special_tokens = True  # the markers are special tokens

    def __init__(self, eager: bool = True) -> None:
        super().__init__(_SEEK, eager)

    def _step_own(self, state: str) -> bool:
        if state == _SEEK:
            if self._seek((CALLS_BEGIN,)) is None:
                return False
            self._state = _BETWEEN
            return True
        if state == _BETWEEN:
            if not self._skip_blank():
                return False
            for marker, then in ((CALL_BEGIN, _TYPE), (CALLS_END, REST)):
                matched = self._match(marker)
                if matched is None:
                    return False
                if matched:
                    if then == REST:
                        self._pending = ""  # the block's end is no content
                    self._state = then
                    return True
            return self._give_up()
        if state in (_TYPE, _NAME):
            end = self._buf.find(SEP if state == _TYPE else "\n")
            if end < 0:
                return False
            piece = self._eat(end)
            if state == _TYPE:
                self._pending += piece + self._eat(len(SEP))
                self._state = _NAME if piece.strip() == "function" else REST
                return True
            if not piece.strip():
                return self._give_up()
            self._begin_call(self._pending + piece, scanner=ArgumentsScanner(piece.strip()))
            self._pending = ""
            self._feed_call("", 0)  # the name is known: send it
            self._state = _FENCE
            return True
        if state == _ARGUMENTS:
            self._eat(self._feed_call(self._buf, 0))
            call = self._call
            assert call is not None
            if call.failed:
                self._fail_call()
                self._state = REST
            elif call.done:
                self._state = _CLOSE
            return call.done or call.failed
        # inside the call, around its arguments: _FENCE, _CLOSE, _CALL_END
        if not self._skip_blank():
            return False
        literal = {_FENCE: FENCE_OPEN, _CLOSE: FENCE_CLOSE, _CALL_END: CALL_END}[state]
        matched = self._match(literal)
        if matched is None:
            return False
        if not matched:
            self._fail_call()
            self._state = REST
            return True
        self._record(self._pending)
        self._pending = ""
        if state == _CALL_END:
            self._state = _BETWEEN if self._end_call() else REST
        else:
            self._state = {_FENCE: _ARGUMENTS, _CLOSE: _CALL_END}[state]
        return True
