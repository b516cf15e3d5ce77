"""Request: the scheduler's record of one request, its tokens, progress and block hashes."""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

from protocol.engine_core import EngineCoreRequest, FinishReason
from protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.block_hash import BlockHash, BlockHasher
    from engine_core.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the FINISHED_* values sort after the live ones."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* statuses."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        """The FinishReason a finished status reports; None while the request lives."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


# Interned stop-id sets (in practice: none, EOS, a few configured stop ids), a bounded number.
_STOP_SETS: dict[frozenset[int], frozenset[int]] = {}


class Request:
    """One request's tokens (prompt then outputs), progress, status and prefix-cache hashes."""

    # What the scheduler reads every step comes first: adjacent, in one or two cache lines
    # (after the model's forward the scheduler finds these objects out of cache).
    __slots__ = (
        "status",
        "all_token_ids",
        "check_at",
        "stop_check_ids",
        "grammar",
        "num_output_placeholders",
        "num_computed_tokens",
        "alloc_limit",
        "block_room",
        "cache_due_at",
        "request_id",
        "prompt_len",
        "max_tokens_total",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "rope_long",
        "client_index",
        "num_cached_tokens",
        "stop_reason",
        "num_preemptions",
        "block_hashes",
        "stop_token_ids",
        "_block_hasher",
        "_hash_at",
        "prefill_chunks",
        "spec_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_len = len(prompt_token_ids)
        # The token count at which max_tokens ends the request (sys.maxsize: no max_tokens).
        max_tokens = sampling_params.max_tokens
        self.max_tokens_total = (
            self.prompt_len + max_tokens if max_tokens is not None else sys.maxsize
        )
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # LongRoPE: turned with the long factors (the scheduler sets it, set_rope_long).
        self.rope_long = False
        self.client_index = client_index
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps in flight, not yet known here.
        self.num_output_placeholders = 0
        # -1 until first scheduled; then the prompt tokens the prefix cache supplied.
        self.num_cached_tokens = -1
        # (Unix time, tokens) of each prompt chunk scheduled; sent with the first output.
        self.prefill_chunks: list[tuple[float, int]] = []
        # Speculative decoding: the drafts proposed for the request's next step (the runner's
        # last output), scheduled with it as far as its limits allow.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        # The scheduler's steady decode path: the tokens that may stop this request (its stop
        # ids, and EOS unless ignored; min_tokens is checked when one comes), the token count
        # at which it next checks stops, length caps and block hashes (the first output is
        # special too), and the num_computed_tokens up to which the KV cache manager has
        # nothing to do for it (its blocks have room, no block completes).
        stop_check_ids = (
            self.stop_token_ids
            if eos_token_id is None or sampling_params.ignore_eos
            else self.stop_token_ids | {eos_token_id}
        )
        # One shared object per distinct set: it stays in cache across requests.
        if len(_STOP_SETS) < 256:
            stop_check_ids = _STOP_SETS.setdefault(stop_check_ids, stop_check_ids)
        self.stop_check_ids = stop_check_ids
        self.check_at = self.prompt_len + 1
        self.alloc_limit = 0
        # The two bounds alloc_limit combines, for a step past it that still needs nothing
        # (async scheduling: the token that fills a block is in flight, so the block cannot be
        # cached yet): the tokens its blocks hold, and the known token count at which the next
        # block is due for caching (both set by the KV cache manager with alloc_limit).
        self.block_room = 0
        self.cache_due_at = 0
        # Structured outputs: the request's compile and matcher (engine_core.structured_output).
        self.grammar: RequestGrammar | None = None
        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        # Token count at which the next full block completes (hashing is due only then).
        self._hash_at = 0
        if block_hasher is not None:
            self._hash_blocks(block_hasher)

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        eos_token_id: int | None,
        block_hasher: BlockHasher | None = None,
    ) -> Request:
        """A Request for an EngineCoreRequest; block_hasher None means prefix caching is off."""
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            client_index=req.client_index,
            block_hasher=block_hasher,
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy: all_token_ids holds them after the prompt)."""
        return self.all_token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        """True once the request stopped, hit a length cap or was aborted."""
        return self.status > RequestStatus.PREEMPTED

    def append_output_token(self, token: int) -> None:
        """Append one generated token and hash the block it completes, if any."""
        all_token_ids = self.all_token_ids
        all_token_ids.append(token)
        hasher = self._block_hasher
        if hasher is not None and len(all_token_ids) >= self._hash_at:
            if len(all_token_ids) == self._hash_at:  # one block completes: most calls
                hasher.hash_next(self)
                self._hash_at += hasher.block_size
            else:
                self._hash_blocks(hasher)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append several generated tokens and hash any blocks they complete."""
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None and len(self.all_token_ids) >= self._hash_at:
            self._hash_blocks(self._block_hasher)

    @property
    def next_hash_len(self) -> int | None:
        """The token count at which the next block hash is due (None: no prefix caching)."""
        return None if self._block_hasher is None else self._hash_at

    def set_rope_long(self) -> None:
        """Turn the request with LongRoPE's long factors from now on; its block hashes are
        recomputed (the flag is part of them: short and long KV never share a block). Only
        while it holds no computed KV (waiting, or just preempted)."""
        self.rope_long = True
        if self._block_hasher is not None:
            self.block_hashes = []
            self._hash_blocks(self._block_hasher)

    def _hash_blocks(self, hasher: BlockHasher) -> None:
        self.block_hashes.extend(hasher(self))
        self._hash_at = (len(self.block_hashes) + 1) * hasher.block_size
