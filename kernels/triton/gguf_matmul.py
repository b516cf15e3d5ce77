"""Triton kernels on GGUF quantized weights (kernels/gguf_device.py's planes): a matmul that
dequantizes each weight tile in registers, and a dequantization of whole rows (an embedding
lookup, or the full weight for a large batch's cuBLAS matmul).

A tile is 32-column groups split into halves, columns j and j + 16 of a group, which is how the
4-bit codes pair in a byte; the halves multiply the matching halves of x, so no shuffle joins
them. Values are gguf.quants' dequantization in fp32, then rounded to x's dtype: the weights of
the model dequantized at load in that dtype. Products accumulate in fp32.

Up to FUSED_MAX_ROWS rows (decode batches) the fused kernel runs: one row takes a dot product
per column; more take tensor-core dots in blocks of up to 64 rows, each block reading the codes
once, so 256 rows read 4 x 4.5 bits a weight in Q4_K, about the bf16 model's 16 bits, where a
dequantized copy would cost 4.5 + 16 + 16. Above that (prefill chunks, compute-bound) a step
dequantizes each weight into x's dtype once and lets cuBLAS multiply.
No host syncs: the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.gguf_device import GROUP, DeviceQuantWeight

# The kernels switch on QTYPE, GGML's type number (gguf.GGMLQuantizationType): Q4_0 2, Q4_1 3,
# Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14.
# Rows up to which the fused kernel runs; above, dequantize once and use cuBLAS.
FUSED_MAX_ROWS = 256
# 128 columns per step of a program: two [BLOCK_N, 4, 16] halves in registers (a K type's
# super-block scale is looked up per group, so any count works).
_GROUPS_PER_TILE = 4


@triton.jit
def _dequant_halves(
    qs_ptr,
    qh_ptr,
    d_ptr,
    m_ptr,
    sc_ptr,
    mn_ptr,
    rows,
    row_mask,
    g0,
    K,
    QTYPE: tl.constexpr,
    G: tl.constexpr,
):
    """Rows `rows` (int64 [BN]) of groups g0 .. g0 + G: columns 32 g + j and 32 g + 16 + j
    (j < 16) as two fp32 [BN, G, 16] tensors, zero where masked."""
    groups = K // 32
    g = g0 + tl.arange(0, G)
    j = tl.arange(0, 16)
    R = rows[:, None, None]
    Gi = g[None, :, None]
    J = j[None, None, :]
    gmask = row_mask[:, None, None] & (Gi < groups)
    mask = gmask & (J < 16)
    gidx = R * groups + Gi
    if QTYPE == 8:
        at = R * K + Gi * 32 + J
        d = tl.load(d_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
        lo = tl.load(qs_ptr + at, mask=mask, other=0).to(tl.float32) * d
        hi = tl.load(qs_ptr + at + 16, mask=mask, other=0).to(tl.float32) * d
    else:
        b = tl.load(qs_ptr + R * (K // 2) + Gi * 16 + J, mask=mask, other=0).to(tl.int32)
        ql = b & 15
        qh = b >> 4
        if QTYPE == 6 or QTYPE == 7 or QTYPE == 13:
            h = tl.load(qh_ptr + gidx, mask=gmask, other=0)
            ql = ql | (((h >> J) & 1) << 4)
            qh = qh | (((h >> (J + 16)) & 1) << 4)
        if QTYPE == 14:
            h0 = tl.load(qh_ptr + gidx * 2, mask=gmask, other=0)
            h1 = tl.load(qh_ptr + gidx * 2 + 1, mask=gmask, other=0)
            ql = ql | (((h0 >> (2 * J)) & 3) << 4)
            qh = qh | (((h1 >> (2 * J)) & 3) << 4)
        if QTYPE == 12 or QTYPE == 13 or QTYPE == 14:
            sup = R * (K // 256) + Gi // 8
            dd = tl.load(d_ptr + sup, mask=gmask, other=0.0).to(tl.float32)
            if QTYPE == 14:
                s_at = R * (K // 16) + Gi * 2
                s_lo = tl.load(sc_ptr + s_at, mask=gmask, other=0).to(tl.float32)
                s_hi = tl.load(sc_ptr + s_at + 1, mask=gmask, other=0).to(tl.float32)
                lo = (dd * s_lo) * (ql - 32).to(tl.float32)
                hi = (dd * s_hi) * (qh - 32).to(tl.float32)
            else:
                dmin = tl.load(m_ptr + sup, mask=gmask, other=0.0).to(tl.float32)
                scale = dd * tl.load(sc_ptr + gidx, mask=gmask, other=0).to(tl.float32)
                low = dmin * tl.load(mn_ptr + gidx, mask=gmask, other=0).to(tl.float32)
                lo = scale * ql.to(tl.float32) - low
                hi = scale * qh.to(tl.float32) - low
        else:
            d = tl.load(d_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
            if QTYPE == 3 or QTYPE == 7:
                m = tl.load(m_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
                lo = d * ql.to(tl.float32) + m
                hi = d * qh.to(tl.float32) + m
            elif QTYPE == 2:
                lo = d * (ql - 8).to(tl.float32)
                hi = d * (qh - 8).to(tl.float32)
            else:
                lo = d * (ql - 16).to(tl.float32)
                hi = d * (qh - 16).to(tl.float32)
    return lo, hi


@triton.jit
def _matmul_kernel(
    x_ptr,
    out_ptr,
    bias_ptr,
    qs_ptr,
    qh_ptr,
    d_ptr,
    m_ptr,
    sc_ptr,
    mn_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    j = tl.arange(0, 16)
    wdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, K // 32, G):
        lo, hi = _dequant_halves(
            qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rows, row_mask, g0, K, QTYPE, G
        )
        # The weights of the model dequantized in x's dtype.
        lo = lo.to(wdt)
        hi = hi.to(wdt)
        g = g0 + tl.arange(0, G)
        x_at = ms[:, None, None] * stride_xm + g[None, :, None] * 32 + j[None, None, :]
        x_mask = m_mask[:, None, None] & (g[None, :, None] < K // 32) & (j[None, None, :] < 16)
        x_lo = tl.load(x_ptr + x_at, mask=x_mask, other=0.0)
        x_hi = tl.load(x_ptr + x_at + 16, mask=x_mask, other=0.0)
        if UPCAST:  # the same values in fp32: 16-bit dots under the interpreter are wrong
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
        if BLOCK_M == 1:
            part = lo.to(tl.float32) * x_lo.to(tl.float32) + hi.to(tl.float32) * x_hi.to(tl.float32)
            acc += tl.sum(tl.sum(part, axis=2), axis=1)[None, :]
        else:
            acc += tl.dot(
                tl.reshape(x_lo, (BLOCK_M, G * 16)),
                tl.trans(tl.reshape(lo, (BLOCK_N, G * 16))),
                input_precision=DOT_PRECISION,
            )
            acc += tl.dot(
                tl.reshape(x_hi, (BLOCK_M, G * 16)),
                tl.trans(tl.reshape(hi, (BLOCK_N, G * 16))),
                input_precision=DOT_PRECISION,
            )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    out_at = ms[:, None] * stride_om + rows[None, :]
    tl.store(out_ptr + out_at, acc, mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def _dequant_kernel(
    out_ptr,
    ids_ptr,
    qs_ptr,
    qh_ptr,
    d_ptr,
    m_ptr,
    sc_ptr,
    mn_ptr,
    R,
    N,
    K,
    stride_o,
    QTYPE: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    G: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    if HAS_IDS:
        rows = tl.load(ids_ptr + r, mask=r_mask, other=0).to(tl.int64)
        row_mask = r_mask & (rows >= 0) & (rows < N)
    else:
        rows = r
        row_mask = r_mask
    g0 = tl.program_id(1) * G
    lo, hi = _dequant_halves(
        qs_ptr, qh_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, rows, row_mask, g0, K, QTYPE, G
    )
    g = g0 + tl.arange(0, G)
    j = tl.arange(0, 16)
    at = r[:, None, None] * stride_o + g[None, :, None] * 32 + j[None, None, :]
    mask = r_mask[:, None, None] & (g[None, :, None] < K // 32) & (j[None, None, :] < 16)
    tl.store(out_ptr + at, lo, mask=mask)
    tl.store(out_ptr + at + 16, hi, mask=mask)


def _planes(w: DeviceQuantWeight) -> tuple[torch.Tensor, ...]:
    """The kernels' plane arguments; a type's unused (empty) planes are passed as qs, which the
    kernel never reads through them, so that no launch gets the null pointer of an empty
    tensor."""
    return tuple(p if p.numel() else w.qs for p in (w.qs, w.qh, w.d, w.m, w.sc, w.mn))


def dequantize(
    w: DeviceQuantWeight, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W's rows `ids` (any shape; all rows when None) as [*ids.shape, in_features] of dtype.
    Ids outside the table give zero rows."""
    flat = None if ids is None else ids.reshape(-1).contiguous()
    count = w.out_features if flat is None else flat.numel()
    out = torch.empty(count, w.in_features, dtype=dtype, device=w.qs.device)
    if count:
        block_r = 16
        grid = (triton.cdiv(count, block_r), triton.cdiv(w.in_features // GROUP, _GROUPS_PER_TILE))
        _dequant_kernel[grid](
            out,
            out if flat is None else flat,
            *_planes(w),
            count,
            w.out_features,
            w.in_features,
            out.stride(0),
            QTYPE=int(w.qtype),
            HAS_IDS=flat is not None,
            BLOCK_R=block_r,
            G=_GROUPS_PER_TILE,
        )
    shape = (w.out_features,) if ids is None else tuple(ids.shape)
    return out.view(*shape, w.in_features)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_n(n: int, row_blocks: int, device: torch.device) -> int:
    """Output columns per program: enough programs to fill the SMs twice over."""
    sms = _multiprocessors(device)
    for block in (64, 32):
        if triton.cdiv(n, block) * row_blocks >= 2 * sms:
            return block
    return 16


def matmul(
    x: torch.Tensor,
    w: DeviceQuantWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in_features] @ W^T (+ bias) -> [M, out_features] in x's dtype (written into out,
    a [M, out_features] view with unit column stride, when given)."""
    rows = x.shape[0]
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.in_features}")
    if out is None:
        out = torch.empty(rows, w.out_features, dtype=x.dtype, device=x.device)
    elif out.shape != (rows, w.out_features) or (w.out_features > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out {tuple(out.shape)} is not [{rows}, {w.out_features}] with packed columns"
        )
    if out.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"out and bias must be x's {x.dtype}")
    if rows > FUSED_MAX_ROWS:
        weight = dequantize(w, dtype=x.dtype).t()
        if bias is None:
            return torch.mm(x, weight, out=out)
        return torch.addmm(bias, x, weight, out=out)
    if rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = 1 if rows == 1 else min(64, max(16, triton.next_power_of_2(rows)))
    # fp32 dots exact ("ieee", not tf32); 16-bit ones in fp32 under the interpreter too.
    upcast = x.dtype == torch.float32 or x.device.type != "cuda"
    block_n = _block_n(w.out_features, triton.cdiv(rows, block_m), x.device)
    if upcast and block_m > 1:
        block_n = 16  # fp32 dots' operands in registers: wider tiles spill (sm_90, Q4_K/Q5_K)
    grid = (triton.cdiv(w.out_features, block_n), triton.cdiv(rows, block_m))
    _matmul_kernel[grid](
        x,
        out,
        out if bias is None else bias,
        *_planes(w),
        rows,
        w.out_features,
        w.in_features,
        x.stride(0),
        out.stride(0),
        QTYPE=int(w.qtype),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        G=_GROUPS_PER_TILE,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    return out
