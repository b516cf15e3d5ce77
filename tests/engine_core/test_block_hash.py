from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from engine_core.block_hash import get_hash_fn, hash_block_tokens, make_block_hasher, root_hash
from engine_core.request import Request
from protocol.sampling_params import SamplingParams


def _request(tokens: list[int], hasher, salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(), None, cache_salt=salt, block_hasher=hasher)


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_hashes_are_chained_per_full_block(algo: str) -> None:
    hasher = make_block_hasher(4, algo)
    req = _request(list(range(10)), hasher)
    assert len(req.block_hashes) == 2  # the partial third block is not hashed
    fn = get_hash_fn(algo)
    h0 = hash_block_tokens(fn, root_hash(algo), [0, 1, 2, 3])
    assert req.block_hashes == [h0, hash_block_tokens(fn, h0, [4, 5, 6, 7])]
    # Same second block after a different first block: a different hash.
    other = _request([9, 9, 9, 9, 4, 5, 6, 7], hasher)
    assert other.block_hashes[1] != req.block_hashes[1]


def test_incremental_hashing_on_append() -> None:
    hasher = make_block_hasher(4)
    req = _request([1, 2, 3], hasher)
    assert req.block_hashes == []
    req.append_output_token(4)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([5, 6, 7])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([8, 9, 10, 11, 12])
    assert req.block_hashes == _request(list(range(1, 13)), hasher).block_hashes


def test_cache_salt_changes_every_block_through_the_first() -> None:
    hasher = make_block_hasher(4)
    plain = _request(list(range(8)), hasher).block_hashes
    salted = _request(list(range(8)), hasher, salt="tenant-a").block_hashes
    other = _request(list(range(8)), hasher, salt="tenant-b").block_hashes
    assert len({plain[0], salted[0], other[0]}) == 3
    assert len({plain[1], salted[1], other[1]}) == 3
    assert salted == _request(list(range(8)), hasher, salt="tenant-a").block_hashes


def test_sha256_hashes_agree_across_processes() -> None:
    code = (
        "from engine_core.block_hash import make_block_hasher;"
        "from engine_core.request import Request;"
        "from protocol.sampling_params import SamplingParams;"
        "r = Request('r', list(range(8)), SamplingParams(), None, cache_salt='s',"
        " block_hasher=make_block_hasher(4));print(r.block_hashes[-1].hex())"
    )
    here = _request(list(range(8)), make_block_hasher(4), salt="s").block_hashes[-1].hex()
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == there


@pytest.mark.skipif(importlib.util.find_spec("xxhash") is not None, reason="xxhash installed")
def test_xxhash_without_package_is_a_clear_error() -> None:
    with pytest.raises(ImportError, match="xxhash"):
        make_block_hasher(4, "xxhash")


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        get_hash_fn("md5")
