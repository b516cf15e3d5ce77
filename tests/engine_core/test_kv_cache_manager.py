from __future__ import annotations

from engine_core.block_hash import make_block_hasher
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from protocol.sampling_params import SamplingParams

BS = 4


def _request(req_id: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(
        req_id,
        tokens,
        SamplingParams(**params),
        None,
        cache_salt=salt,
        block_hasher=make_block_hasher(BS),
    )


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Schedule the whole prompt of req as the scheduler would; returns the cached token count."""
    blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_second_request_reuses_the_shared_prefix() -> None:
    kv = KVCacheManager(16, BS, True, 64)
    first = _request("a", list(range(10)))
    assert _admit(kv, first) == 0
    second = _request("b", list(range(8)) + [50, 51, 52])
    assert _admit(kv, second) == 8
    shared = kv.req_to_blocks["a"][:2]
    assert kv.req_to_blocks["b"][:2] == shared and all(b.ref_cnt == 2 for b in shared)
    assert kv.get_block_ids("b")[2] not in kv.get_block_ids("a")
    assert kv.make_prefix_cache_stats() == (10 + 11, 8)
    assert kv.make_prefix_cache_stats() == (0, 0)


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    kv = KVCacheManager(16, BS, True, 64)
    _admit(kv, _request("a", list(range(8))))
    again = _request("b", list(range(8)))
    # 8 tokens are cached, but at most 7 may count: rounded down to one block.
    assert _admit(kv, again) == 4
    again9 = _request("c", list(range(9)))
    assert _admit(kv, again9) == 8


def test_prompt_logprobs_and_disabled_caching_skip_the_cache() -> None:
    kv = KVCacheManager(16, BS, True, 64)
    _admit(kv, _request("a", list(range(9))))
    assert kv.get_computed_blocks(_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)
    off = KVCacheManager(16, BS, False, 64)
    _admit(off, _request("a", list(range(9))))
    assert off.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)


def test_cache_salt_separates_tenants() -> None:
    kv = KVCacheManager(16, BS, True, 64)
    _admit(kv, _request("a", list(range(9)), salt="x"))
    assert _admit(kv, _request("b", list(range(9)), salt="y")) == 0
    assert _admit(kv, _request("c", list(range(9)))) == 0
    assert _admit(kv, _request("d", list(range(9)), salt="x")) == 8


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(4, BS, True, 64)
    req = _request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is not None
    other = _request("b", list(range(100, 108)))
    assert kv.allocate_slots(other, 8) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []


def test_hits_on_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(3, BS, True, 64)
    first = _request("a", list(range(9)))
    _admit(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 3
    # Two cached blocks hit, but touching them leaves one free block: 9 + 4 tokens need 4.
    second = _request("b", list(range(8)) + list(range(50, 55)))
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8
    assert kv.allocate_slots(second, 5, blocks) is None
    assert kv.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in blocks)


def test_eviction_is_least_recently_freed_tail_first() -> None:
    kv = KVCacheManager(6, BS, True, 64)
    old = _request("old", list(range(12)))
    new = _request("new", list(range(100, 112)))
    _admit(kv, old)
    _admit(kv, new)
    old_ids, new_ids = kv.get_block_ids("old"), kv.get_block_ids("new")
    kv.free(old)
    kv.free(new)
    assert kv.pool.free_queue.block_ids() == old_ids[::-1] + new_ids[::-1]
    # Needing two blocks evicts old's last two blocks: its first block still hits.
    kv.allocate_slots(_request("x", list(range(200, 208))), 8)
    assert kv.get_computed_blocks(_request("o2", list(range(12))))[1] == 4
    assert kv.get_computed_blocks(_request("n2", list(range(100, 112))))[1] == 8


def test_decode_caches_blocks_as_they_fill() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    req = _request("a", [1, 2, 3])
    _admit(kv, req)
    for token in (4, 5):
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    # Tokens 1..4 fill block 0 (token 4 computed in the second decode step): it is cached.
    assert kv.get_computed_blocks(_request("b", [1, 2, 3, 4, 9]))[1] == 4


def test_reset_prefix_cache_after_free() -> None:
    kv = KVCacheManager(8, BS, True, 64)
    req = _request("a", list(range(9)))
    _admit(kv, req)
    assert not kv.reset_prefix_cache()
    kv.free(req)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_request("b", list(range(9))))[1] == 0
