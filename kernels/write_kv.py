"""Scattering new tokens' keys and values into the paged KV cache, three ways side by side:
write_kv, the Triton kernel (kernels/triton/write_kv.py); write_kv_cpu, the C kernel
(kernels/cpu/write_kv.c) in the CPU backend's layout; and write_kv_ref, the slow torch reference the
tests compare against.

An fp8 cache (--kv-cache-dtype fp8: float8_e4m3fn) stores each key as k / k_scale and each value
as v / v_scale, rounded to the nearest e4m3 and saturated at +-448 (quantize_kv); the attention
kernels read value * scale back in fp32.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import check_cpu, check_rows, library

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float8_e4m3fn (divided in fp32, rounded to nearest even, saturated at
    +-448): what an fp8 cache stores, bit for bit as the kernels write it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's k/v [T, Hkv, D] into cache slot slot_mapping[t] (negative: skipped), in
    the CPU layout paged_attention() reads; into an fp8 cache (float8_e4m3fn) as
    quantize_kv(k, k_scale) and quantize_kv(v, v_scale)."""
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    for t, name in ((k, "k"), (v, "v")):
        check_cpu(t, name)
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        check_cpu(t, name, cache_dtype)
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
    args = (
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
    )
    if fp8:
        library().write_kv_fp8(*args, k_scale, v_scale, torch.get_num_threads())
    else:
        library().write_kv_f32(*args, torch.get_num_threads())


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t]; negative slots are
    skipped. An fp8 cache gets quantize_kv(key, k_scale) and quantize_kv(value, v_scale)."""
    if key_cache.dtype == torch.float8_e4m3fn:
        # Copies into float8 tensors have no CPU kernel: write the bytes.
        key = quantize_kv(key, k_scale).view(torch.uint8)
        value = quantize_kv(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[t]
        value_cache[block, offset] = value[t]
