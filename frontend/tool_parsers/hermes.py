"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5/3, SmolLM3, ...):
<tool_call>{"name": "f", "arguments": {...}}</tool_call>, possibly several, with content
around them."""

from __future__ import annotations

from frontend.tool_parsers.streamer import ToolCallParser, partial_suffix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallParser):
    """Calls between <tool_call> and </tool_call>; a last call may lack its closing tag."""

    # Some models make the tags special tokens; decoding must keep them (as vLLM does).
    needs_special_tokens = True

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._tail = ""  # text that may begin a tag, held until more text comes
        self._closing = False  # the call's object ended; reading up to </tool_call>

    def _consume(self, text: str) -> None:
        text, self._tail = self._tail + text, ""
        i = 0
        while i < len(text):
            if self._call is None:
                k = text.find(START, i)
                if k < 0:
                    keep = partial_suffix(text[i:], START)
                    self._content(text[i : len(text) - keep])
                    self._tail = text[len(text) - keep :]
                    return
                self._content(text[i:k])
                self._begin_call(START)
                self._closing = False
                i = k + len(START)
            elif not self._closing:
                i = self._read_object(text, i)
            else:
                i = self._read_to_end(text, i)

    def _read_object(self, text: str, i: int) -> int:
        """Feed the call's object up to a </tool_call> outside its strings (an unclosed
        object ends there)."""
        call = self._call
        assert call is not None
        end = text.find(END, i)
        while end >= 0:
            i = self._feed_call(text[:end], i)
            if call.done or call.failed or not call.in_string:
                self._closing = True
                return i
            end = text.find(END, end + 1)
        limit = len(text) - partial_suffix(text[i:], END)
        i = self._feed_call(text[:limit], i)
        if call.done or call.failed:
            self._closing = True
            return i
        self._tail = text[limit:]
        return len(text)

    def _read_to_end(self, text: str, i: int) -> int:
        """Skip to </tool_call> (or a next <tool_call>, when the closing tag is missing)."""
        end, start = text.find(END, i), text.find(START, i)
        if start >= 0 and (end < 0 or start < end):
            self._record(text[i:start])
            self._end_call()
            return start
        if end < 0:
            keep = max(partial_suffix(text[i:], END), partial_suffix(text[i:], START))
            self._record(text[i : len(text) - keep])
            self._tail = text[len(text) - keep :]
            return len(text)
        self._record(text[i : end + len(END)])
        self._end_call()
        return end + len(END)

    def _end_of_output(self) -> None:
        if self._call is None:
            self._content(self._tail)
        else:
            self._record(self._tail)
        self._tail = ""
