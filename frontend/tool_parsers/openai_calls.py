"""A choice's tool calls in OpenAI's response shapes: call ids, the streamed deltas (index, id,
type and name first with empty arguments, then arguments pieces), the message's calls and the
finish reason."""

from __future__ import annotations

from collections.abc import Callable

from frontend.openai_protocol import (
    ChatDelta,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from frontend.tool_parsers.streamer import ExtractedToolCalls, ToolCallParser, openai_call_id


def call_id() -> str:
    """A new tool call id, in OpenAI's form."""
    return openai_call_id()


def finish_reason(reason: str | None, called: bool) -> str | None:
    """tool_calls when calls were made and the output ended with stop; length stays length."""
    return "tool_calls" if called and reason == "stop" else reason


def message_calls(
    extracted: ExtractedToolCalls, parallel: bool, new_id: Callable[[], str] = call_id
) -> list[ToolCall] | None:
    """The calls of a whole output for the response message (only the first without parallel),
    with ids from new_id (the parser's call_id: some formats need their own)."""
    calls = extracted.calls if parallel else extracted.calls[:1]
    return [
        ToolCall(id=new_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ] or None


class StreamedCalls:
    """One streamed choice: its parser, and the ids it gave its calls."""

    def __init__(self, parser: ToolCallParser, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self.called = False

    def deltas(self, text: str, finished: bool) -> list[ChatDelta]:
        """The chunks' deltas for the next piece of output, in order."""
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        out = []
        for event in events:
            if isinstance(event, str):
                out.append(ChatDelta(content=event))
            elif event.index == 0 or self.parallel:
                if event.name is not None:
                    self.called = True
                    call = DeltaToolCall(
                        index=event.index,
                        id=self.parser.call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=event.name, arguments=""),
                    )
                else:
                    call = DeltaToolCall(
                        index=event.index, function=DeltaFunctionCall(arguments=event.arguments)
                    )
                out.append(ChatDelta(tool_calls=[call]))
        return out
