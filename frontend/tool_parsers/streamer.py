"""The base of every tool call parser: a model's output, fed as text deltas, split into content
and tool calls, as events a streaming response sends on at once.

One parser instance reads one completion (one choice). Streaming (eager) parsers send a call's
first event as soon as its name is known, then its arguments as they grow; a call that turns
out malformed after that stays a call with the arguments it had. Non-streaming reading
(extract) holds each call until it is complete and returns a malformed one to the content, so
a malformed call is never reported as one. Both give a call's arguments as the model wrote
them, so a stream's pieces join to the non-streaming answer.
"""

from __future__ import annotations

import uuid
from typing import NamedTuple, Protocol

from frontend.tool_parsers.json_scan import CallObjectScanner


class ToolCallDelta(NamedTuple):
    """A piece of one tool call: its name on the call's first piece, then arguments text."""

    index: int  # type: ignore[assignment]  # the call's position in the output, from 0
    name: str | None
    arguments: str


# What a parser emits: content text, or a piece of a tool call.
StreamEvent = str | ToolCallDelta


class ToolCall(NamedTuple):
    """A complete tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ExtractedToolCalls(NamedTuple):
    """A whole output read at once: the text outside calls (None when blank) and the calls."""

    content: str | None
    calls: list[ToolCall]


class CallScanner(Protocol):
    """What reads one call's text: CallObjectScanner (a JSON call object), ArgumentsScanner
    (a call whose name came first: its JSON arguments)."""

    name: str | None
    done: bool
    failed: bool

    @property
    def valid(self) -> bool: ...

    @property
    def in_string(self) -> bool: ...

    def feed(self, text: str, pos: int = 0) -> tuple[int, str]: ...


def openai_call_id() -> str:
    """A new tool call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that could begin marker (held until more text)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Base of the parsers: subclasses implement _consume (and _end_of_output when they hold
    text), calling _content, _begin_call, _feed_call, _record and _end_call.

    Content keeps trailing whitespace back until more content follows: whitespace before a
    call is dropped, and at the end it is sent only when there were no calls.
    """

    # Whether the calls' markers are special tokens that decoding must keep.
    needs_special_tokens = False
    # Whether the parser reads the request's tools (their parameters' JSON schemas): it is
    # then made with tools={name: parameters schema}.
    uses_tool_schemas = False

    def __init__(self, eager: bool = True) -> None:
        self.eager = eager
        self.num_calls = 0
        self._out: list[StreamEvent] = []
        self._held_whitespace = ""
        self._wrote_content = False
        self._call: CallScanner | None = None
        self._call_raw: list[str] = []
        self._call_events: list[ToolCallDelta] = []
        self._call_args: list[str] = []
        self._call_started = False
        self._call_sent = False

    # ---- the interface ----

    def feed(self, text: str) -> list[StreamEvent]:
        """Read the next piece of output; the events it completes."""
        if text:
            self._consume(text)
        return self._take()

    def finish(self) -> list[StreamEvent]:
        """The output ended; the events still held."""
        self._end_of_output()
        if self._call is not None:
            self._end_call()
        if self._wrote_content and self.num_calls == 0 and self._held_whitespace:
            self._out.append(self._held_whitespace)
        self._held_whitespace = ""
        return self._take()

    def extract(self, text: str) -> ExtractedToolCalls:
        """Read a whole output at once, with a fresh parser (malformed calls stay content)."""
        self.eager = False
        return collect(self.feed(text) + self.finish())

    @staticmethod
    def call_id() -> str:
        """A new id for a call this parser read (OpenAI's form unless the format needs its own)."""
        return openai_call_id()

    # ---- for subclasses ----

    def _consume(self, text: str) -> None:
        raise NotImplementedError

    def _end_of_output(self) -> None:
        """Hand on text a subclass still holds (a partial marker)."""

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._out.append(self._held_whitespace + body)
            self._held_whitespace = ""
            self._wrote_content = True
        self._held_whitespace += text[len(body) :]

    def _begin_call(
        self,
        marker: str = "",
        argument_keys: tuple[str, ...] = ("arguments", "parameters"),
        scanner: CallScanner | None = None,
    ) -> None:
        """A call starts (marker: its opening text, returned to the content if it fails), read by
        scanner (default: a JSON call object with these argument keys)."""
        self._call = scanner if scanner is not None else CallObjectScanner(argument_keys)
        self._call_raw = [self._held_whitespace + marker]
        self._held_whitespace = ""
        self._call_events, self._call_args = [], []
        self._call_started = self._call_sent = False

    def _feed_call(self, text: str, pos: int, record: bool = True) -> int:
        """Feed text[pos:] to the call's scanner; the index after what it consumed. record=False:
        the text is not the model's (arguments a parser converted; it records the model's text
        with _record)."""
        call = self._call
        assert call is not None
        end, arguments = call.feed(text, pos)
        if record:
            self._call_raw.append(text[pos:end])
        if arguments:
            self._call_args.append(arguments)
        if call.name is not None:
            if not self._call_started:
                self._call_started = True
                self._call_events.append(ToolCallDelta(self.num_calls, call.name, ""))
            if self._call_args:
                self._call_events.append(
                    ToolCallDelta(self.num_calls, None, "".join(self._call_args))
                )
                self._call_args = []
        if self.eager and self._call_events:
            self._out.extend(self._call_events)
            self._call_events = []
            self._call_sent = True
        return end

    def _record(self, text: str) -> None:
        """Text of the call outside its object (a closing marker)."""
        self._call_raw.append(text)

    def _end_call(self) -> bool:
        """The call's text ended; whether it counts as a call (else its text is content)."""
        call = self._call
        assert call is not None
        self._call = None
        if self._call_sent or call.valid:
            self._out.extend(self._call_events)
            self.num_calls += 1
            return True
        self._content("".join(self._call_raw))
        return False

    def _take(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for event in self._out:  # adjacent content and argument pieces merged
            last = out[-1] if out else None
            if isinstance(event, str) and isinstance(last, str):
                out[-1] = last + event
            elif (
                isinstance(event, ToolCallDelta)
                and isinstance(last, ToolCallDelta)
                and event.name is None
                and last.name is None
                and last.index == event.index
            ):
                out[-1] = last._replace(arguments=last.arguments + event.arguments)
            else:
                out.append(event)
        self._out = []
        return out


def collect(events: list[StreamEvent]) -> ExtractedToolCalls:
    """Join a whole output's events into its content and complete calls."""
    content = "".join(e for e in events if isinstance(e, str))
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                names[e.index] = e.name
            arguments.setdefault(e.index, []).append(e.arguments)
    return ExtractedToolCalls(
        content if content.strip() else None,
        [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)],
    )
