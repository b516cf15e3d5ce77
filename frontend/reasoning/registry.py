"""--reasoning-parser names (vLLM's) and the parser each builds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from frontend.reasoning.deepseek_r1 import DeepSeekR1Parser
from frontend.reasoning.granite import GraniteParser
from frontend.reasoning.parser import ReasoningParser
from frontend.reasoning.qwen3 import Qwen3Parser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GraniteParser)
}
# gpt-oss's reasoning is its harmony analysis channel, which serving_harmony reads already.
HARMONY_REASONING_PARSER = "openai_gptoss"
REASONING_PARSER_NAMES = sorted([*REASONING_PARSERS, HARMONY_REASONING_PARSER])


def reasoning_parser(
    name: str | None, tokenizer: PreTrainedTokenizerBase
) -> ReasoningParser | None:
    """The parser --reasoning-parser names, or None (no parser, or gpt-oss's harmony);
    ValueError for an unknown name or a tokenizer the parser cannot read."""
    if name is None or name == HARMONY_REASONING_PARSER:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown --reasoning-parser {name!r}; choose one of "
            f"{', '.join(REASONING_PARSER_NAMES)}"
        )
    return REASONING_PARSERS[name](tokenizer)
