"""Scattering new tokens' keys and values into the paged KV cache, three ways side by side:
write_kv, the Triton kernel (kernels/triton/write_kv.py); write_kv_cpu, the C kernel
(kernels/cpu/write_kv.c) in the CPU backend's layout; and write_kv_ref, the slow torch reference the
tests compare against.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, check_rows, library


def cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """The block, slot and head strides of the [num_blocks, block_size, Hkv, D] key cache, then
    the value cache's: the stride arguments of the kernels that read or write the caches, in
    their order."""
    return (*key_cache.stride()[:3], *value_cache.stride()[:3])


def write_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's k/v [T, Hkv, D] into cache slot slot_mapping[t] (negative: skipped), in
    the CPU layout paged_attention() reads."""
    for t, name in ((k, "k"), (v, "v"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        check_cpu(t, name)
    check_cpu(slot_mapping, "slot_mapping", torch.int64)
    check_rows(k, "k")
    check_rows(v, "v")
    num_blocks, kv_heads, head_dim, block_size = key_cache.shape
    if not (
        key_cache.is_contiguous() and value_cache.is_contiguous() and slot_mapping.is_contiguous()
    ):
        raise ValueError("caches and slot_mapping must be contiguous")
    if (
        k.shape[1:] != (kv_heads, head_dim)
        or v.shape != k.shape
        or slot_mapping.shape[0] != k.shape[0]
    ):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache")
    library().write_kv_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slot_mapping.data_ptr(),
        k.shape[0],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_heads,
        head_dim,
        block_size,
        torch.get_num_threads(),
    )


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are
    skipped."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[t]
        value_cache[block, offset] = value[t]
