"""x @ W^T for integer weights in kernels/int_device.py's layout: a Marlin-style Triton GEMM.

A program loads a [BLOCK_K / pack, BLOCK_N] tile of packed int32 words, unpacks the codes in
registers (each word read once, shifted by its pack's bit offsets into pack rows of codes), scales
them (w = scale * code + offset in fp32, rounded to x's dtype: the model's weights dequantized in
that dtype) and feeds tl.dot with x's [BLOCK_M, BLOCK_K] tile, accumulating in fp32.

Few rows (decode, 1 to 64) are bound by reading W: BLOCK_M 16 (the smallest tensor-core tile) and
split-K, so that the grid fills the SMs twice over even where N / BLOCK_N does not; each split
writes fp32 partial sums that one reduction adds. The cost then stays the bytes of W from 1 row
to 16-32. Many rows take 64 x 128 tiles and no split. The configuration is a function of the
shape (M bucket, N, K, the SM count), never autotuned at run time, so captured CUDA graphs replay
the launches they recorded. No host syncs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.int_device import DeviceIntWeight


@triton.jit
def _int_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    bias_ptr,
    M,
    N,
    K,
    GS,
    k_per_split,
    stride_xm,
    stride_om,
    stride_os,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    ns = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < N
    ms = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    kk = tl.arange(0, BLOCK_K)
    wi = tl.arange(0, BLOCK_K // PACK)
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    wdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + kk
        k_mask = ks < k_end
        # Each word once: [BLOCK_K / PACK, BLOCK_N], its PACK codes unpacked in registers
        # (word i, code p) -> row i * PACK + p of the [BLOCK_K, BLOCK_N] tile.
        w_rows = k0 // PACK + wi
        words = tl.load(
            q_ptr + w_rows[:, None].to(tl.int64) * N + ns[None, :],
            mask=(w_rows < k_end // PACK)[:, None] & n_mask[None, :],
            other=0,
        )
        codes = (words[:, None, :] >> shifts) & MASK
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if TILE_GROUP:  # BLOCK_K divides the group: one row of scales for the tile
            g = k0 // GS
            scale = tl.load(s_ptr + g * N + ns, mask=n_mask, other=0.0)
            offset = tl.load(o_ptr + g * N + ns, mask=n_mask, other=0.0)
            w = codes * scale[None, :] + offset[None, :]
        else:
            at = (ks // GS)[:, None].to(tl.int64) * N + ns[None, :]
            wmask = k_mask[:, None] & n_mask[None, :]
            w = codes * tl.load(s_ptr + at, mask=wmask, other=0.0) + tl.load(
                o_ptr + at, mask=wmask, other=0.0
            )
        w = w.to(wdt)
        xt = tl.load(
            x_ptr + ms[:, None] * stride_xm + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if UPCAST:  # the same values in fp32: 16-bit dots under the interpreter are wrong
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc += tl.dot(xt, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_at = pid_k.to(tl.int64) * stride_os + ms[:, None] * stride_om + ns[None, :]
    tl.store(out_ptr + out_at, acc, mask=m_mask[:, None] & n_mask[None, :])


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_k(k: int, group_size: int, wanted: int) -> int:
    """The K tile: wanted, or the group where it is smaller (one scale row per tile)."""
    if group_size < k:
        return max(16, min(wanted, group_size))
    return max(16, min(wanted, triton.next_power_of_2(k)))


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> Config:
    """The launch configuration for an [m, k] x [k, n] product: by M bucket, then split-K for
    few rows where N's tiles alone leave SMs idle (module note)."""
    sms = _multiprocessors(device)
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = 64
        block_k = _block_k(k, group_size, 128)
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        k_tiles = triton.cdiv(k, block_k)
        split = 1
        while split * 2 <= k_tiles and tiles * split < 2 * sms and split < 16:
            split *= 2
        return Config(block_m, block_n, block_k, split, 4, 4)
    block_n = 128 if device.type == "cuda" else 64
    return Config(64, block_n, _block_k(k, group_size, 64), 1, 8 if block_n == 128 else 4, 3)


def matmul(
    x: torch.Tensor,
    w: DeviceIntWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in_features] @ W^T (+ bias) -> [M, out_features] in x's dtype (written into out,
    a [M, out_features] view with unit column stride, when given)."""
    rows, n, k = x.shape[0], w.out_features, w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (rows, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out {tuple(out.shape)} is not [{rows}, {n}] with packed columns")
    if out.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"out and bias must be x's {x.dtype}")
    if rows == 0:
        return out
    if w.perm is not None:
        x = x.index_select(1, w.perm)  # act-order: x's columns in the groups' order
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = choose_config(rows, n, k, w.group_size, x.device)
    k_tiles = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    # fp32 dots exact ("ieee", not tf32); 16-bit ones in fp32 under the interpreter too.
    upcast = x.dtype == torch.float32 or x.device.type != "cuda"
    target = out
    if split > 1:  # fp32 partial sums, one [M, N] per split, added below
        target = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, cfg.block_m), split)
    _int_matmul_kernel[grid](
        x,
        w.qweight,
        w.scales,
        w.offsets,
        target,
        x if bias is None else bias,
        rows,
        n,
        k,
        w.group_size,
        k_per_split,
        x.stride(0),
        target.stride(-2),
        target.stride(0) if split > 1 else 0,
        BITS=w.bits,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        TILE_GROUP=w.group_size % cfg.block_k == 0 or w.group_size >= k,
        HAS_BIAS=bias is not None and split == 1,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        total = target.sum(0)
        if bias is not None:
            total += bias.to(torch.float32)
        out.copy_(total)
    return out
