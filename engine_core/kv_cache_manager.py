"""KVCacheManager: which blocks each request holds, prefix-cache lookups and slot allocation.

With a model-wide sliding window W (config/kv_window.py) a request that has computed C tokens
gives back its blocks wholly before position C - W + 1, which no later query of any layer reads
(as vLLM's SlidingWindowManager): each such entry of its block list becomes the pool's
null_block, so list indices stay positions. Freed blocks keep their prefix-cache hashes and
join the free queue like a finished request's, evictable; a later prefix hit needs every block
from the start still cached (the lookup stops at the first one evicted), and at admission the
hits wholly before the new request's first window are not taken at all.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine_core.block_pool import BlockPool, KVCacheBlock
from engine_core.request import Request

# Request.cache_due_at without prefix caching: no block is ever due.
_NEVER = sys.maxsize


class KVCacheManager:
    """Allocates blocks for requests' tokens and shares full blocks through the prefix cache."""

    # allocate_slots caches a block a decode completes, and gives a decode entering a new block
    # that block, without the general path (off: the differential tests' full path).
    cache_only_path = True
    alloc_one_path = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        max_model_len: int,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # The model-wide window behind which blocks are freed (None: every block is kept), and
        # how many leading entries of each request's list are freed (the null block).
        self.sliding_window = sliding_window
        self.num_skipped_blocks: dict[str, int] = {}
        self._queries = 0
        self._hits = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, and its token count.

        At most num_tokens - 1 tokens count as cached, so the last token is always computed and
        produces logits. Requests asking for prompt logprobs skip the cache: they need every
        position.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        cached = self.pool.cached
        blocks: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self._queries += request.num_tokens
        self._hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Blocks for num_new_tokens more tokens after the computed ones (and the cache hits).

        Returns the newly allocated blocks, or None, changing nothing, when they do not fit (the
        blocks behind a model-wide window are given back either way). Caches the request's
        blocks that these tokens complete.
        """
        req_id = request.request_id
        block_size = self.block_size
        req_blocks = self.req_to_blocks.get(req_id)
        if self.sliding_window is not None and req_blocks:
            self._free_behind_window(request, req_blocks)
        if req_blocks is not None and not new_computed_blocks:
            # The common case, a decode whose last block has room and completes no block to
            # cache: nothing to do (checked first, it is most of the calls).
            num_total_tokens = request.num_computed_tokens + num_new_tokens
            if num_total_tokens <= len(req_blocks) * block_size:
                if not self.enable_caching:
                    return []
                # As below: blocks full by the end of this step, min(total, num_tokens) // bs.
                num_cached = self.num_cached_blocks.get(req_id, 0)
                num_full = min(num_total_tokens, len(request.all_token_ids)) // block_size
                if num_full <= num_cached:
                    return []
                if self.cache_only_path:
                    # A decode completing a block in the blocks it holds (every block_size
                    # tokens): cache it, nothing to allocate; what the general path does then.
                    self.pool.cache_full_blocks(
                        req_blocks, request.block_hashes, num_cached, num_full
                    )
                    self.num_cached_blocks[req_id] = num_full
                    room = len(req_blocks) * block_size
                    due = (num_full + 1) * block_size
                    request.alloc_limit = min(room, due - 1)
                    request.block_room = room
                    request.cache_due_at = due
                    return []
            elif num_total_tokens <= (len(req_blocks) + 1) * block_size and self.alloc_one_path:
                # A decode entering a new block (every block_size tokens): one block from the
                # free queue, and what it completes cached; what the general path does then.
                pool = self.pool
                if not pool.free_queue.num_free_blocks:
                    return None
                block = pool.get_new_block()
                req_blocks.append(block)
                room = len(req_blocks) * block_size
                if self.enable_caching:
                    num_full = min(num_total_tokens, len(request.all_token_ids)) // block_size
                    start = self.num_cached_blocks.get(req_id, 0)
                    if num_full > start:
                        pool.cache_full_blocks(req_blocks, request.block_hashes, start, num_full)
                        self.num_cached_blocks[req_id] = start = num_full
                    due = (start + 1) * block_size
                    request.alloc_limit = min(room, due - 1)
                    request.cache_due_at = due
                else:
                    request.alloc_limit = room
                    request.cache_due_at = _NEVER
                request.block_room = room
                return [block]
        computed: Sequence[KVCacheBlock] = new_computed_blocks or ()
        if req_blocks is None:
            req_blocks = []
        num_skipped = 0
        if self.sliding_window is not None and computed:
            computed, num_skipped = self._skip_hits_behind_window(request, req_blocks, computed)
        num_total_tokens = request.num_computed_tokens + len(computed) * block_size + num_new_tokens
        num_new_blocks = -(-num_total_tokens // block_size) - len(req_blocks) - len(computed)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0 or computed:
            # Hits nobody holds sit in the free queue and stop being allocatable once touched.
            num_free = self.pool.get_num_free_blocks()
            null = self.pool.null_block
            num_free -= sum(1 for b in computed if b.ref_cnt == 0 and b is not null)
            if num_new_blocks > num_free:
                return None
            if num_skipped:
                self.num_skipped_blocks[req_id] = len(req_blocks) + num_skipped
            if computed:
                self.pool.touch(b for b in computed if b is not null)
                req_blocks.extend(computed)
                self.num_cached_blocks[req_id] = len(req_blocks)
            if num_new_blocks > 0:
                new_blocks = self.pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
        self.req_to_blocks[req_id] = req_blocks
        room = limit = len(req_blocks) * block_size
        due = _NEVER
        if self.enable_caching:
            # Blocks whose tokens are computed by the end of this step; hashes exist for them.
            num_full = min(num_total_tokens, request.num_tokens) // block_size
            start = self.num_cached_blocks.get(req_id, 0)
            if num_full > start:
                self.pool.cache_full_blocks(req_blocks, request.block_hashes, start, num_full)
                self.num_cached_blocks[req_id] = num_full
                start = num_full
            # Until the next block completes there is nothing to cache.
            due = (start + 1) * block_size
            limit = min(limit, due - 1)
        # The scheduler skips this call while num_computed_tokens + new tokens stays within
        # alloc_limit; past it, while that stays within block_room and the known tokens (the
        # request's num_tokens) below cache_due_at: what this call would do nothing for.
        request.alloc_limit = limit
        request.block_room = room
        request.cache_due_at = due
        return new_blocks

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Withdraw the hashes allocate_slots gave blocks this step when the step is taken back.

        Only this request holds those blocks (hits are looked up after running requests are
        scheduled), so no one has read them yet.
        """
        req_id = request.request_id
        request.alloc_limit = request.block_room = 0
        start = request.num_computed_tokens // self.block_size
        end = self.num_cached_blocks.get(req_id, 0)
        if end > start:
            self.pool.uncache_blocks(self.req_to_blocks[req_id][start:end])
            self.num_cached_blocks[req_id] = start

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest."""
        request.alloc_limit = request.block_room = 0
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        if blocks:
            self.pool.free_blocks(reversed(blocks[skipped:]))

    def _free_behind_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Give back the request's blocks wholly before its next query's window (that query is
        at num_computed_tokens), caching the full ones first; their entries become null_block."""
        assert self.sliding_window is not None
        block_size = self.block_size
        end = (request.num_computed_tokens - self.sliding_window + 1) // block_size
        req_id = request.request_id
        start = self.num_skipped_blocks.get(req_id, 0)
        if end <= start:
            return
        if self.enable_caching:
            # Full by now (they precede computed tokens); a hash can still be due for one when
            # the window is short. Later caching starts past them: they are null entries then.
            num_cached = self.num_cached_blocks.get(req_id, 0)
            if num_cached < end:
                upto = min(end, len(request.block_hashes))
                if upto > num_cached:
                    self.pool.cache_full_blocks(blocks, request.block_hashes, num_cached, upto)
                self.num_cached_blocks[req_id] = end
        freed = blocks[start:end]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self.num_skipped_blocks[req_id] = end
        # Oldest first: the first evicted of them, as a finished request's prefix is last.
        self.pool.free_blocks(freed)

    def _skip_hits_behind_window(
        self, request: Request, req_blocks: list[KVCacheBlock], hits: Sequence[KVCacheBlock]
    ) -> tuple[Sequence[KVCacheBlock], int]:
        """The prefix hits with those wholly before the first computed query's window (at the
        hits' end) replaced by null_block, which the request never takes, and their count."""
        assert self.sliding_window is not None
        first = request.num_computed_tokens + len(hits) * self.block_size
        skip = (first - self.sliding_window + 1) // self.block_size - len(req_blocks)
        if skip <= 0:
            return hits, 0
        return [self.pool.null_block] * skip + list(hits[skip:]), skip

    def get_block_ids(self, request_id: str) -> list[int]:
        """Block ids the request holds, in token order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by requests."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return self.pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False while requests hold blocks."""
        return self.pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) since the last call."""
        stats = (self._queries, self._hits)
        self._queries = self._hits = 0
        return stats
