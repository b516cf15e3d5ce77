"""KV cache blocks, their free queue and the prefix-cache map from block hash to block.

No block is reserved as a null block: every one of num_blocks is allocatable. The runner pads
its block tables with 0 but only ever writes through real entries (slot_mapping covers real
tokens only), so a placeholder is not needed and the engine reports num_blocks as given. The
pool's null_block (id 0, outside the pool) stands in a request's block list for a block freed
behind a sliding window (kv_cache_manager.py): the list stays positional, and no kernel reads
an entry before the window, so its id aliasing block 0 is harmless.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.block_hash import BlockHash


class KVCacheBlock:
    """One block of KV cache: its id, how many requests hold it, its hash once full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash!r})"


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels remove the empty-list and end-of-list branches from every operation.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block at the head (the next to be evicted)."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (the last to be evicted)."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids from head to tail, for tests and debugging."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All KV blocks; free ones are evicted least-recently-freed first, cached ones are shared."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # Never allocated, freed, referenced or cached: see the module's docstring.
        self.null_block = KVCacheBlock(0)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks; {self.free_queue.num_free_blocks} free")
        return [self.get_new_block() for _ in range(n)]

    def get_new_block(self) -> KVCacheBlock:
        """The block at the head of the free queue, its cached hash evicted (a decode's next
        block)."""
        block = self.free_queue.popleft()  # ValueError when none is free
        block_hash = block.block_hash
        if block_hash is not None:
            if self.cached.get(block_hash) is block:
                del self.cached[block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits, pulling unreferenced ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop a reference to each block; unreferenced ones join the tail in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Register blocks[start:end] under block_hashes[start:end] in the prefix cache."""
        if not self.enable_caching:
            return
        cached, null = self.cached, self.null_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block is null:
                continue
            block_hash = block_hashes[i]
            # A twin computed concurrently keeps the first registration; this copy stays private.
            if block_hash not in cached:
                cached[block_hash] = block
                block.block_hash = block_hash

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Remove blocks from the prefix cache (their contents will not be computed)."""
        for block in blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block holding this hash, if any."""
        return self.cached.get(block_hash)

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
