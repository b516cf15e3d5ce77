"""The grammar backend (xgrammar) bound to the model's vocabulary: compiles parsed grammars."""

from __future__ import annotations

import logging
import time

import xgrammar as xgr
from transformers import AutoTokenizer

logger = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token of the model's (padded) vocabulary."""
    return (vocab_size + 31) // 32


class GrammarBackend:
    """xgrammar's view of the tokenizer (token strings, stop tokens) and its compiler."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        # vocab_size is the model's (the logits' width), which may pad the tokenizer's.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # The manager keeps its own cache, keyed by the request's constraint.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        logger.info(
            "grammar backend ready for %s in %.2f s", tokenizer_path, time.perf_counter() - start
        )

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        """The grammar against this vocabulary: what a matcher needs to fill bitmasks."""
        return self.compiler.compile_grammar(grammar)
