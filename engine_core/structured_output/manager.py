"""StructuredOutputManager: compiles constraints off the busy loop and keeps one matcher per
constrained request, which fills that request's row of each step's token bitmask.

A request's grammar is parsed where the request arrives (the engine core's I/O thread; a bad
one is refused there) and compiled on the manager's own thread, once per distinct constraint:
requests with equal constraints share one compile, done or in progress. The scheduler admits a
constrained request once its compile is done; the busy loop never waits for one while it has
other work.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
import xgrammar as xgr

from engine_core.structured_output.backend import GrammarBackend, bitmask_width
from engine_core.structured_output.grammar import build_grammar, grammar_key
from engine_core.structured_output.reasoning_gate import ReasoningGate
from protocol.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a compiled JSON-schema grammar is tens to hundreds of KB).
_CACHE_SIZE = 512


class RequestGrammar:
    """One request's constraint: its compile (shared) and, once compiled, its own matcher;
    for a reasoning model, the gate that holds the grammar back until the reasoning ends."""

    __slots__ = ("compiled", "_matcher", "reasoning")

    def __init__(
        self, compiled: Future[xgr.CompiledGrammar], reasoning: ReasoningGate | None = None
    ) -> None:
        self.compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        self.reasoning = reasoning

    @property
    def active(self) -> bool:
        """True once the grammar constrains the output (no reasoning, or it has ended)."""
        return self.reasoning is None or self.reasoning.ended

    @property
    def ready(self) -> bool:
        """True once the compile ended (in success or failure)."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        """Why the compile failed (after ready), else None."""
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it. A token of
        the reasoning goes to the gate instead (the grammar starts with the next one)."""
        if self.reasoning is not None and not self.reasoning.ended:
            self.reasoning.feed(token_id)
            return True
        return self.matcher.accept_token(token_id)

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts (speculative decoding) the grammar allows from its state
        now, short of a token that would end it; the matcher is left as it was. 0 while a
        reasoning gate still holds the grammar back (its end is seen token by token)."""
        if not self.active:
            return 0
        matcher = self.matcher
        n = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Grammar compiles (cached, on one thread) and the bitmask of each step."""

    def __init__(
        self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], max_num_seqs: int
    ) -> None:
        self._tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._backend: Future[GrammarBackend] | None = None
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        # Rows for the requests that sample in one step; shipped as bytes with the step.
        self._bitmask = torch.zeros((max_num_seqs, bitmask_width(vocab_size)), dtype=torch.int32)

    def request_grammar(
        self, params: StructuredOutputsParams, reasoning_end: list[list[int]] | None = None
    ) -> RequestGrammar:
        """Start (or share) the compile of a request's constraint; ValueError when invalid.
        With reasoning_end the grammar applies only after the output ends with one of those
        token sequences (ReasoningGate).

        Thread-safe: the engine core process calls it from its I/O thread.
        """
        key = grammar_key(params)
        gate = ReasoningGate(reasoning_end) if reasoning_end else None
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None and not (compiled.done() and compiled.exception()):
                self._cache.move_to_end(key)
                return RequestGrammar(compiled, gate)
        grammar = build_grammar(params)  # parse outside the lock; raises ValueError
        with self._lock:
            if self._backend is None:  # the first constrained request loads the vocabulary
                self._backend = self._pool.submit(
                    GrammarBackend, self._tokenizer_path, self.vocab_size, self._stop_token_ids
                )
            backend = self._backend
            compiled = self._cache.get(key)
            if compiled is None or (compiled.done() and compiled.exception()):
                compiled = self._pool.submit(lambda: backend.result().compile(grammar))
                self._cache[key] = compiled
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            return RequestGrammar(compiled, gate)

    @staticmethod
    def wait_any(grammars: list[RequestGrammar], timeout: float) -> None:
        """Block until one of the compiles ends, or timeout seconds."""
        wait([g.compiled for g in grammars], timeout=timeout, return_when=FIRST_COMPLETED)

    def fill_bitmask(
        self, grammars: list[RequestGrammar], drafts: list[list[int]] | None = None
    ) -> bytes:
        """The next-token bitmask of each grammar, one row each, as little-endian int32 bytes;
        with drafts (speculative decoding: ones valid_drafts allowed), 1 + len(drafts[i]) rows
        for grammar i: the mask before each of its drafts and after the last."""
        num_rows = len(grammars) + (sum(map(len, drafts)) if drafts else 0)
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = torch.zeros((num_rows, self._bitmask.shape[1]), dtype=torch.int32)
        bitmask = self._bitmask
        row = 0
        for i, grammar in enumerate(grammars):
            if not grammar.active:  # still reasoning: every token allowed
                bitmask[row].fill_(-1)
                row += 1
                continue
            matcher = grammar.matcher
            matcher.fill_next_token_bitmask(bitmask, row)
            row += 1
            ahead = drafts[i] if drafts else ()
            for token in ahead:
                if not matcher.accept_token(token):
                    raise RuntimeError(f"draft token {token} is outside the grammar")
                matcher.fill_next_token_bitmask(bitmask, row)
                row += 1
            if ahead:
                matcher.rollback(len(ahead))
        return bitmask[:row].numpy().astype("<i4", copy=False).tobytes()

    def shutdown(self) -> None:
        """Stop the compile thread (compiles in progress finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
