"""ReasoningGate: holds a reasoning model's grammar back until its reasoning ends.

vLLM's rule (its structured-output manager asks the reasoning parser is_reasoning_end): the
constraint applies to the answer only. The request carries the token sequences that end the
reasoning (SamplingParams.reasoning_end_token_ids, from the API server's reasoning parser);
until the output ends with one of them every token is allowed and the grammar is not fed, and
from the next token on the grammar masks and advances. A request whose reasoning never ends is
unconstrained throughout.
"""

from __future__ import annotations

from collections import deque


class ReasoningGate:
    """Watches one request's sampled tokens for the end of its reasoning."""

    __slots__ = ("_ends", "_recent", "ended")

    def __init__(self, end_sequences: list[list[int]]) -> None:
        self._ends = [tuple(s) for s in end_sequences]
        # The last tokens sampled, as many as the longest end sequence.
        self._recent: deque[int] = deque(maxlen=max(map(len, self._ends)))
        self.ended = False

    def feed(self, token_id: int) -> None:
        """Take a sampled token of the reasoning; sets ended once an end sequence completes."""
        recent = self._recent
        recent.append(token_id)
        for end in self._ends:
            n = len(end)
            if n <= len(recent) and tuple(recent)[-n:] == end:
                self.ended = True
                return
