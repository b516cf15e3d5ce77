"""write_kv, the Triton kernel scattering new tokens' keys and values into the paged KV cache
(kernels/write_kv.py holds its C twin and the torch reference). Imported only where it runs: on
CUDA, and in the tests under TRITON_INTERPRET=1.

Into an fp8 cache (float8_e4m3fn) the kernel writes x / scale rounded to e4m3 in integer
arithmetic (e4m3_bits): the same bytes as torch's conversion (quantize_kv) on every device and
under the interpreter, whose own float8 conversion rounds otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.write_kv import cache_strides


@triton.jit
def e4m3_bits(x):
    """The float8_e4m3fn bytes (as uint32) of fp32 x: nearest, ties to even, saturated at
    +-448, NaN kept, as torch's conversion."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # >= 2^-6, a normal e4m3: 3 mantissa bits rounded to even, the exponent rebiased 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Below, a subnormal m * 2^-9: m = |x| * 2^9 rounded to even from the 24-bit significand.
    exponent = (a >> 23).to(tl.int32) - 127
    # >= 21 where used, 31 rounding to 0; clamped for every lane (a shift past 31 is undefined).
    shift = tl.minimum(tl.maximum(14 - exponent, 1), 31).to(tl.uint32)
    sig = (a & 0x7FFFFF) | 0x800000
    m = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    m += ((rem > half) | ((rem == half) & ((m & 1) == 1))).to(tl.uint32)
    bits = tl.where(a >= 0x3C800000, normal, m)
    bits = tl.where(a >= 0x43E00000, 0x7E, bits)  # >= 448 and inf: saturate
    bits = tl.where(a > 0x7F800000, 0x7F, bits)  # NaN
    return sign | bits


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
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
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
    if FP8:
        # The caches are passed as their uint8 views; IEEE division, as torch's x / scale.
        k = e4m3_bits(tl.math.div_rn(k.to(tl.float32), k_scale))
        v = e4m3_bits(tl.math.div_rn(v.to(tl.float32), v_scale))
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's key/value [Hkv, D] into cache slot slot_mapping[t] in place; negative
    slots are skipped. Into an fp8 cache (float8_e4m3fn) as quantize_kv(key, k_scale) and
    quantize_kv(value, v_scale), bit for bit."""
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
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
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
        float(k_scale),
        float(v_scale),
        HEAD_DIM=head_dim,
        NUM_ELEMS=num_elems,
        BLOCK=triton.next_power_of_2(num_elems),
        BLOCK_SIZE=key_cache.shape[1],
        FP8=fp8,
    )
