"""What chat completions asks of the server's reasoning parser for one request: the engine core's
end ids on a constrained request, and each choice's split of its text into reasoning and
content (include_reasoning false drops the reasoning, as vLLM does)."""

from __future__ import annotations

from typing import Any

from frontend.openai_protocol import ChatDelta, ChatResponseMessage
from frontend.reasoning.parser import ReasoningParser
from frontend.reasoning.stream import ReasoningStream, split_reasoning
from protocol.sampling_params import SamplingParams


class ChatReasoning:
    """One chat request's reasoning split."""

    def __init__(
        self,
        parser: ReasoningParser,
        chat_template_kwargs: dict[str, Any] | None,
        include_reasoning: bool = True,
    ) -> None:
        self.parser = parser
        self.kwargs = chat_template_kwargs or {}
        self.include = include_reasoning
        self._streams: dict[int, ReasoningStream] = {}

    def prepare_params(self, params: SamplingParams) -> None:
        """A structured output applies after the reasoning: the engine core's end ids. Marker
        tokens that are special are kept in the text, where the split finds them."""
        if self.parser.needs_special_tokens:
            params.skip_special_tokens = False
        if params.structured_outputs is not None:
            params.reasoning_end_token_ids = self.parser.end_token_ids(self.kwargs)

    def message(self, role: str, text: str) -> ChatResponseMessage:
        """A whole choice's message: its reasoning (under both names) and content, None where
        empty."""
        reasoning, content = split_reasoning(self.parser.stream(self.kwargs), text)
        if not self.include:
            reasoning = None
        return ChatResponseMessage(
            role=role, content=content, reasoning=reasoning, reasoning_content=reasoning
        )

    def stream_delta(self, index: int, text: str, finished: bool) -> tuple[ChatDelta | None, str]:
        """Choice index's next delta: its reasoning piece (None when it has none) and the
        content text, which goes on as the answer (to the tool-call parser, if any)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self.parser.stream(self.kwargs)
        reasoning, content = stream.feed(text, finished)
        if not reasoning or not self.include:
            return None, content
        return ChatDelta(reasoning=reasoning, reasoning_content=reasoning), content


def chat_reasoning(
    parser: ReasoningParser | None,
    chat_template_kwargs: dict[str, Any] | None,
    include_reasoning: bool,
    params: SamplingParams,
) -> ChatReasoning | None:
    """The request's reasoning split (None without a parser), its structured output (if any)
    moved after the reasoning."""
    if parser is None:
        return None
    reasoning = ChatReasoning(parser, chat_template_kwargs, include_reasoning)
    reasoning.prepare_params(params)
    return reasoning


def content_delta(head: ChatDelta | None, text: str) -> ChatDelta:
    """A streamed delta of content text after the reasoning piece head (if any)."""
    if head is None:
        return ChatDelta(content=text)
    head.content = text or None
    return head
