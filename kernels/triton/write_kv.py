"""write_kv, the Triton kernel scattering new tokens' keys and values into the paged KV cache
(kernels/write_kv.py holds its C twin and the torch reference). Imported only where it runs: on
CUDA, and in the tests under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.write_kv import cache_strides


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_ELEMS
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    # int64 so that large caches (> 2**31 elements) do not overflow the address math.
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + head * stride_vh + dim, mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + dim
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + dim
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t] in place; negative
    slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (
        f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}"
    )
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (
        "key_cache must be [num_blocks, block_size, Hkv, D]"
    )
    assert value_cache.shape == key_cache.shape, "value_cache must have key_cache's shape"
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *cache_strides(key_cache, value_cache),
        HEAD_DIM=head_dim,
        NUM_ELEMS=num_elems,
        BLOCK=triton.next_power_of_2(num_elems),
        BLOCK_SIZE=key_cache.shape[1],
    )
