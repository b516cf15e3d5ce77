"""deepseek_r1: DeepSeek-R1 and its distills. The chat template ends the prompt with `<think>\n`,
so the output starts inside the reasoning and `</think>` ends it; a `<think>` the model writes
itself is dropped. Without `</think>` (cut by max_tokens) everything is reasoning, as in vLLM."""

from __future__ import annotations

from typing import Any

from frontend.reasoning.parser import ThinkTagParser
from frontend.reasoning.stream import Opening


class DeepSeekR1Parser(ThinkTagParser):
    name = "deepseek_r1"

    def opening(self, kwargs: dict[str, Any]) -> Opening:
        return Opening.REASONING
