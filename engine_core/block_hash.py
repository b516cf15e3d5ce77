"""Chained hashes of full KV blocks: block i's hash certifies every token up to its end.

hash(block) = H((parent_hash, tuple(block token ids), extra_keys)); the first block's parent is
a constant root and its extra_keys carry the request's cache_salt, so salted tenants never share,
and LongRoPE's long flag, so KV turned with the long factors never serves a short request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

BlockHash = bytes | int
HashFn = Callable[[Any], BlockHash]


class HashedTokens(Protocol):
    """What a BlockHasher reads of a request (engine_core.request.Request is one): its tokens,
    its cache salt and the hashes of its full blocks so far, which hash_next appends to."""

    all_token_ids: list[int]
    cache_salt: str | None
    rope_long: bool
    block_hashes: list[BlockHash]


_ROOT_SEED = b"engine_core.block_hash.root.v1:"
_encode = msgspec.msgpack.Encoder().encode


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(_encode(obj)).digest()


def _builtin(obj: Any) -> int:
    return hash(obj)


def get_hash_fn(algo: str) -> HashFn:
    """The hash function for 'sha256' (default), 'xxhash' (needs the xxhash package) or 'builtin'.

    sha256 and xxhash hash a canonical msgpack encoding, so they agree across processes;
    'builtin' is Python's hash(): fastest, not collision-safe, meaningful within one process only.
    """
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError as e:
            raise ImportError(
                "prefix_caching_hash_algo='xxhash' needs the xxhash package (pip install xxhash); "
                "or use 'sha256'"
            ) from e
        digest = xxhash.xxh3_128_digest
        return lambda obj: digest(_encode(obj))
    if algo == "builtin":
        return _builtin
    raise ValueError(f"unknown prefix caching hash algorithm {algo!r}")


def root_hash(algo: str) -> BlockHash:
    """The parent hash of every first block: a constant of the algorithm, equal in every process."""
    digest = hashlib.sha256(_ROOT_SEED + algo.encode()).digest()
    # builtin hashes are ints; keeping the root an int too keeps the key type uniform.
    return int.from_bytes(digest[:8], "little") if algo == "builtin" else digest


def hash_block_tokens(
    hash_fn: HashFn, parent_hash: BlockHash, token_ids: list[int], extra_keys: Any = None
) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    return hash_fn((parent_hash, tuple(token_ids), extra_keys))


def _first_extra(request: HashedTokens) -> Any:
    """The first block's extra keys: the cache salt, and LongRoPE's long flag where set (KV
    turned with the long factors never serves a short request, nor the reverse)."""
    if request.rope_long:
        return ("rope_long", request.cache_salt)
    return request.cache_salt


class BlockHasher:
    """Callable: the hashes of a request's newly completed full blocks, in order."""

    __slots__ = ("block_size", "_hash_fn", "_root", "_as_list")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self._hash_fn = get_hash_fn(algo)
        self._root = root_hash(algo)
        # msgpack encodes a list and a tuple alike, so sha256 and xxhash hash the token slice
        # itself; builtin hash() needs the (hashable) tuple.
        self._as_list = algo != "builtin"

    def __call__(self, request: HashedTokens) -> list[BlockHash]:
        hashes = request.block_hashes
        block_size = self.block_size
        start = len(hashes)
        end = len(request.all_token_ids) // block_size
        if end <= start:
            return []
        hash_fn = self._hash_fn
        parent = hashes[-1] if hashes else self._root
        tokens = request.all_token_ids
        new: list[BlockHash] = []
        for i in range(start, end):
            extra = _first_extra(request) if i == 0 else None
            parent = hash_fn((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
            new.append(parent)
        return new

    def hash_next(self, request: HashedTokens) -> None:
        """Append the hash of the one block the request's tokens have just completed (its
        block_hashes cover every block before it): what __call__ returns then, without the
        loop and the list."""
        hashes = request.block_hashes
        block_size = self.block_size
        i = len(hashes)
        start = i * block_size
        tokens = request.all_token_ids[start : start + block_size]
        hashes.append(
            self._hash_fn(
                (
                    hashes[-1] if i else self._root,
                    tokens if self._as_list else tuple(tokens),
                    _first_extra(request) if i == 0 else None,
                )
            )
        )


def make_block_hasher(block_size: int, algo: str = "sha256") -> BlockHasher:
    """The block hasher of a block size and hash algorithm."""
    return BlockHasher(block_size, algo)
