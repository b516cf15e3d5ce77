from __future__ import annotations

import pytest

from engine_core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def test_free_queue_popleft_remove_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    for _ in range(4):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_allocate_touch_free_refcounts() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 1, 2)
    pool.touch([a])
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 0, 3)
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 4 and pool.usage == 0.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_cached_block_is_evicted_when_reallocated() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free_blocks([b, a])  # tail first: b is evicted before a
    assert pool.get_cached_block(b"ha") is a
    (first,) = pool.get_new_blocks(1)
    assert first is b and first.block_hash is None
    assert pool.get_cached_block(b"hb") is None and pool.get_cached_block(b"ha") is a
    pool.touch([a])  # a hit on a free cached block takes it off the free queue
    assert pool.get_num_free_blocks() == 0 and a.ref_cnt == 1


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is a and b.block_hash is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 2)
    assert pool.get_cached_block(b"x") is None


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and a.block_hash is None
