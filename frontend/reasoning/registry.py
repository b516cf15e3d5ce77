"""--reasoning-parser names (vLLM's) and the parser each builds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from frontend.reasoning.deepseek_r1 import DeepSeekR1Parser
from frontend.reasoning.granite import GraniteParser
from frontend.reasoning.parser import ReasoningParser, missing_tokens_message
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


def check_tokenizer_files(name: str | None, tokenizer_dir: str) -> None:
    """ValueError, before anything loads, when the model's tokenizer.json lacks a token the
    parser needs (<think>, </think>); a tokenizer without tokenizer.json is checked when the
    API server loads it."""
    parser = REASONING_PARSERS.get(name or "")
    needed = getattr(parser, "REQUIRED_TOKENS", ())
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not needed or not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    entries = (data.get("model") or {}).get("vocab") or ()
    # BPE and WordPiece map token -> id; Unigram lists [token, score] pairs.
    vocab = {e[0] if isinstance(e, list) and e else e for e in entries}
    vocab.update(t.get("content") for t in data.get("added_tokens") or ())
    missing = [t for t in needed if t not in vocab]
    if missing:
        raise ValueError(missing_tokens_message(str(name), missing))
