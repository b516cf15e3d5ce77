"""qwen3: Qwen3 writes `<think>...</think>` before its answer (the Thinking-2507 templates put
`<think>` in the prompt; the dropped leading tag covers both). With chat_template_kwargs
{"enable_thinking": false} the template closes an empty reasoning in the prompt and the output
is all answer, as vLLM's Qwen3ReasoningParser reads it."""

from __future__ import annotations

from typing import Any

from frontend.reasoning.parser import ThinkTagParser
from frontend.reasoning.stream import Opening


class Qwen3Parser(ThinkTagParser):
    name = "qwen3"

    def opening(self, kwargs: dict[str, Any]) -> Opening:
        if kwargs.get("enable_thinking", True) is False:
            return Opening.ANSWER
        return Opening.REASONING
