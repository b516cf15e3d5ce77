"""Integer-coded weights (GPTQ, AWQ: W = scale * code + offset per group of inputs) as GGUF blocks
for the CPU kernels (kernels/cpu/quant_linear.c), bit for bit the same W.

Each 32-input block takes its group's scale and offset (a group of 64, 128 or K inputs repeats
them over its blocks), and the whole weight becomes the most compact GGUF type that holds it
exactly:
    Q4_0 (18 bytes a block)  w = d * (q - 8)   integer zero points, code - zero in [-8, 7]
    Q4_1 (20 bytes)          w = d * q + m     4-bit codes, offsets exact in fp16 (m = offset)
    Q5_0 (22 bytes)          w = d * (q - 16)  integer zero points, code - zero in [-16, 15]
    Q8_0 (34 bytes)          w = d * q         integer zero points, code - zero in [-128, 127]
with d the group's scale, which must be exact in fp16 (GPTQ and AWQ store fp16 scales). So a
symmetric 4-bit GPTQ weight (zero point 8) is Q4_0; an asymmetric 4-bit one (AWQ, GPTQ with zero
points) is Q5_0, since its offset -scale * zero needs up to 15 bits of mantissa (fp16 has 11)
while code - zero always fits 5 bits; a symmetric 8-bit one (zero point 128) is Q8_0.
Most compact, not always fastest: on the 2-core dev box, where the few-rows kernel is bound by
its vector ops, an 8192x2048 weight at 1 row took 0.82 ms as Q5_0 and 0.55 as Q8_0 (Q4_0 0.49,
fp32 1.7; 2 threads); where memory bandwidth bounds a step, bytes decide.

Why exact: with d an fp16 value and |q| below 2**8, d * q, scale * code and scale * zero are
exact in fp32 and so is their difference, so d * (q - zero) equals the reference's
fl(scale * code + offset). The conversion does not rely on the argument: it computes the chosen
type's W as the kernels dequantize it, compares it with the reference, and takes the next type
where they differ. Where no type holds W exactly, int_to_gguf raises NoExactGGUF saying why.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf.constants import GGML_QUANT_SIZES

from kernels.gguf_quant import QuantizedWeight, pack

BLOCK = 32  # inputs per GGUF block (every type used here)
_CHUNK_ROWS = 1024  # rows checked at a time: bounds the fp32 copies of W the check makes
_ZERO_BIAS = {GGMLType.Q4_0: 8, GGMLType.Q5_0: 16, GGMLType.Q8_0: 0}
_CODE_RANGE = {GGMLType.Q4_0: (0, 15), GGMLType.Q5_0: (0, 31), GGMLType.Q8_0: (-128, 127)}


class NoExactGGUF(ValueError):
    """No GGUF type the CPU kernels run holds this weight exactly (the message says why)."""


def int_to_gguf(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> QuantizedWeight:
    """W [N, K] = scales * codes + offsets (uint8 codes [N, K], fp32 scales and offsets
    [N, K / group_size], W in the codes' input order) packed for the C kernels as the most
    compact GGUF type that dequantizes to the same fp32 W, bit for bit."""
    codes = codes.to(device="cpu", dtype=torch.uint8).contiguous()
    scales = scales.to(device="cpu", dtype=torch.float32).contiguous()
    offsets = offsets.to(device="cpu", dtype=torch.float32).contiguous()
    n, k = codes.shape
    if k % BLOCK or group_size % BLOCK or k % group_size:
        raise NoExactGGUF(
            f"group size {group_size} over {k} inputs is not whole GGUF blocks of {BLOCK}"
        )
    if not torch.equal(scales.to(torch.float16).to(torch.float32), scales):
        raise NoExactGGUF("its scales are not exact in fp16 (every GGUF type's d is fp16)")
    zeros = _zero_points(scales, offsets)
    types, why = _types(codes, zeros, offsets, group_size)
    for qtype in types:
        if _exact(qtype, codes, scales, offsets, zeros, group_size):
            raw = _blocks(qtype, codes, scales, offsets, zeros, group_size)
            return pack(qtype, raw.reshape(n, -1), n, k)
        why.append(f"{qtype.name} differs from W")
    raise NoExactGGUF("; ".join(why))


def _zero_points(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """Each group's integer zero point z (offset == -scale * z) as fp32 [N, groups], or None
    where an offset is not one."""
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    z = torch.where(scales == 0, torch.zeros_like(scales), -offsets / safe)
    if not (torch.equal(z, z.round()) and torch.equal(-scales * z, offsets)):
        return None
    return z


def _types(
    codes: torch.Tensor, zeros: torch.Tensor | None, offsets: torch.Tensor, group_size: int
) -> tuple[list[GGMLType], list[str]]:
    """The types whose code range holds W, most compact first; and why the others do not."""
    found, why = [], []
    if zeros is None:
        why.append("its offsets are not -scale * an integer zero point (Q4_0, Q5_0, Q8_0)")
    else:
        n, groups = zeros.shape
        by_group = codes.view(n, groups, group_size)
        lo = int((by_group.amin(-1).to(torch.float32) - zeros).min())
        hi = int((by_group.amax(-1).to(torch.float32) - zeros).max())
        for qtype in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0):
            low, top = _CODE_RANGE[qtype]
            if low <= lo + _ZERO_BIAS[qtype] and hi + _ZERO_BIAS[qtype] <= top:
                found.append(qtype)
        if not found:
            why.append(f"code - zero spans [{lo}, {hi}], beyond int8 (Q8_0)")
    if int(codes.max()) >= 16:
        why.append("its codes exceed 4 bits (Q4_1)")
    elif not torch.equal(offsets.to(torch.float16).to(torch.float32), offsets):
        why.append("its offsets are not exact in fp16 (Q4_1)")
    else:
        found.append(GGMLType.Q4_1)
    return sorted(found, key=lambda t: GGML_QUANT_SIZES[t][1]), why


def _exact(
    qtype: GGMLType,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> bool:
    """Whether qtype's W, as the kernels dequantize it (d * (q - bias) or d * q + m, d and m
    fp16), equals the reference's fl(scale * code + offset) everywhere. W's value is a function
    of (group, code) only, so where a group has more inputs than there are code values, every
    (group, code value) pair is compared instead of every weight: the same check, cheaper."""
    n, k = codes.shape
    groups = k // group_size
    levels = int(codes.max()) + 1
    for start in range(0, n, _CHUNK_ROWS):
        rows = slice(start, min(start + _CHUNK_ROWS, n))
        s, o = scales[rows].unsqueeze(-1), offsets[rows].unsqueeze(-1)
        if levels < group_size:
            c = torch.arange(levels, dtype=torch.float32).view(1, 1, levels)
        else:
            c = codes[rows].view(-1, groups, group_size).to(torch.float32)
        reference = c * s + o
        d = s.to(torch.float16).to(torch.float32)
        if qtype == GGMLType.Q4_1:
            values = c * d + o.to(torch.float16).to(torch.float32)
        else:
            assert zeros is not None
            values = (c - zeros[rows].unsqueeze(-1)) * d
        if not torch.equal(values, reference):
            return False
    return True


def _blocks(
    qtype: GGMLType,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> np.ndarray:
    """W as qtype's GGUF blocks, [N, K / 32, block bytes]."""
    n, k = codes.shape
    blocks, per_group = k // BLOCK, group_size // BLOCK
    d = scales.to(torch.float16).repeat_interleave(per_group, dim=1)
    parts = [d.numpy().view(np.uint8).reshape(n, blocks, 2)]
    if qtype == GGMLType.Q4_1:
        m = offsets.to(torch.float16).repeat_interleave(per_group, dim=1)
        parts.append(m.numpy().view(np.uint8).reshape(n, blocks, 2))
        q = codes.numpy()
    else:
        assert zeros is not None
        shift = (zeros - _ZERO_BIAS[qtype]).to(torch.int16).unsqueeze(-1)
        q16 = codes.view(n, -1, group_size).to(torch.int16) - shift
        q = q16.to(torch.int8 if qtype == GGMLType.Q8_0 else torch.uint8).numpy().view(np.uint8)
    q = q.reshape(n, blocks, BLOCK)
    if qtype == GGMLType.Q8_0:
        parts.append(q)
    elif qtype == GGMLType.Q5_0:
        parts.append(np.packbits(q >> 4, axis=-1, bitorder="little"))  # bit j: element j's 5th
        parts.append(_nibble_pairs(q & 15))
    else:
        parts.append(_nibble_pairs(q))
    return np.concatenate(parts, axis=-1)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit codes as GGML's 16 bytes: element j low, element j + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)
