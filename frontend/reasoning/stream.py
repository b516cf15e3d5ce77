"""ReasoningStream: one choice's text split into reasoning and answer as it arrives.

The reasoning is delimited by text markers (a tag such as `</think>`, or a phrase such as
Granite's "Here is my response:"), found in the text, not in token ids, so that a marker split
over two deltas (or over several tokens) is found all the same: text that may still be the start
of a marker is held back until the next delta settles it, and let go when the choice finishes.
Feeding the whole text at once gives the same split as feeding it in any pieces.
"""

from __future__ import annotations

from enum import Enum


class Opening(Enum):
    """Where a choice's output starts."""

    REASONING = "reasoning"  # inside the reasoning; a leading start marker is dropped
    ANSWER = "answer"  # in the answer (the prompt closed the reasoning): all content
    MARKED = "marked"  # reasoning only if the output starts with a start marker


class ReasoningStream:
    """Splits one choice's text into (reasoning, content) pieces, delta by delta."""

    def __init__(self, starts: tuple[str, ...], ends: tuple[str, ...], opening: Opening) -> None:
        self._starts = starts
        self._ends = ends
        self._state = "answer" if opening is Opening.ANSWER else "prologue"
        self._required_start = opening is Opening.MARKED
        self._held = ""  # text not yet given out: maybe the start of a marker
        self.reasoned = False  # True once any text was read as reasoning

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """This delta's reasoning and content ("" where none); finished lets held text go."""
        reasoning, content = "", ""
        text = self._held + text
        self._held = ""
        if self._state == "prologue":
            text = self._prologue(text, finished)
        if self._state == "reasoning":
            reasoning, text = self._reasoning(text, finished)
        if self._state == "answer":
            content = text
        return reasoning, content

    def _prologue(self, text: str, finished: bool) -> str:
        """Before the reasoning: drop a start marker; hold text that may still become one."""
        body = text.lstrip()
        for start in self._starts:
            if body.startswith(start):
                self._state = "reasoning"
                self.reasoned = True
                return body[len(start) :]
        if not finished and any(start.startswith(body) for start in self._starts):
            self._held = text
            return ""
        self._state = "answer" if self._required_start else "reasoning"
        self.reasoned = self._state == "reasoning"
        return text

    def _reasoning(self, text: str, finished: bool) -> tuple[str, str]:
        """Inside the reasoning: the text before the first end marker is reasoning, the rest is
        the answer; without a marker, hold the tail that may begin one."""
        found = [(i, end) for end in self._ends if (i := text.find(end)) >= 0]
        if found:
            i, end = min(found)
            self._state = "answer"
            return text[:i], text[i + len(end) :]
        keep = 0 if finished else _partial_suffix(text, self._ends)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that is a proper prefix of one of markers."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


def split_reasoning(stream: ReasoningStream, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None when empty."""
    reasoning, content = stream.feed(text, finished=True)
    return reasoning or None, content or None
