"""granite: IBM Granite 3.2+ with chat_template_kwargs {"thinking": true} answers
"Here is my thought process: ... Here is my response: ..." ("Here's" too, which vLLM also
accepts). The reasoning is read only when the output starts with the first phrase; otherwise it
is all answer. The engine core's end ids are the response phrase's tokens (alone and after a
space), and only with thinking on: without it Granite does not reason and structured outputs
start at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend.reasoning.parser import ReasoningParser
from frontend.reasoning.stream import Opening

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class GraniteParser(ReasoningParser):
    name = "granite"
    STARTS = ("Here is my thought process:", "Here's my thought process:")
    ENDS = ("Here is my response:", "Here's my response:")

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(tokenizer)
        ends: list[list[int]] = []
        for phrase in self.ENDS:
            for text in (phrase, " " + phrase):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids not in ends:
                    ends.append(ids)
        self._end_ids = ends

    def opening(self, kwargs: dict[str, Any]) -> Opening:
        return Opening.MARKED

    def end_token_ids(self, kwargs: dict[str, Any]) -> list[list[int]] | None:
        return self._end_ids if kwargs.get("thinking") else None
