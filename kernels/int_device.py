"""Integer weights (kernels/quant_weights.py's IntWeight) in the layout of the Triton
kernel (kernels/triton/int_matmul.py), and GGUF's 4- and 8-bit types converted to IntWeight.

The layout is the Marlin / GPTQ-Triton one: the codes transposed to [K, N] and packed along K,
8 nibbles (or 4 bytes) to an int32 word, so a program's [BLOCK_K / pack, BLOCK_N] tile of words
is BLOCK_K / pack runs of BLOCK_N consecutive words (coalesced loads, a quarter or an eighth of
the rows a byte layout reads); scales and offsets per group as [groups, N] fp32, one row of
BLOCK_N per tile where BLOCK_K divides the group. An act-order perm stays a gather of x's
columns before the kernel (x is small, W is not).

GGUF: Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m), Q8_0 (w = d q, q signed: code q + 128, offset
-128 d) and Q4_K (w = (d sc) q - dmin mn per 32 columns) are exactly scale * code + offset with
fp32 scales and offsets: every product above is of an fp16 and an integer of at most 8 bits, so
exact in fp32, and the one rounding left is the kernel's add, as in gguf.quants. Q5_*/Q6_K keep
kernels/triton/gguf_matmul.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType as GGMLType

from kernels.gguf_device import DeviceQuantWeight
from kernels.quant_weights import IntWeight

# The GGUF types converted to IntWeight on CUDA (run by the int kernel).
GGUF_INT_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K})


class DeviceIntWeight(NamedTuple):
    """A [out_features, in_features] integer weight in the Triton kernel's layout."""

    qweight: torch.Tensor  # int32 [K / pack, N]: code (k, n) at bits (k % pack) * bits
    scales: torch.Tensor  # float32 [groups, N]
    offsets: torch.Tensor  # float32 [groups, N]
    bits: int
    group_size: int  # in_features for one group per row
    perm: torch.Tensor | None  # int64 [K]: x's columns in the kernel's order

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * self.pack

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_int(w: IntWeight) -> DeviceIntWeight:
    """w in the kernel's layout, on w's device (a few device ops)."""
    if w.bits not in (4, 8):
        raise ValueError(f"{w.bits}-bit integer weights have no Triton kernel (4 and 8 do)")
    n, k = w.codes.shape
    pack = 32 // w.bits
    if k % pack or k % w.group_size:
        raise ValueError(
            f"in_features {k} must be a multiple of {pack} and of the group size {w.group_size}"
        )
    codes = w.codes.t().to(torch.int64).reshape(k // pack, pack, n)
    shifts = torch.arange(pack, device=codes.device, dtype=torch.int64).view(1, pack, 1) * w.bits
    words = (codes << shifts).sum(1)  # disjoint bits: the sum is the or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return DeviceIntWeight(
        words.contiguous(),
        w.scales.to(torch.float32).t().contiguous(),
        w.offsets.to(torch.float32).t().contiguous(),
        w.bits,
        w.group_size,
        w.perm,
    )


def unpack_codes(w: DeviceIntWeight, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The codes [N (or len(columns)), K] as int32 (columns: output rows of W to read)."""
    words = w.qweight if columns is None else w.qweight[:, columns]
    shifts = torch.arange(w.pack, device=words.device, dtype=torch.int32) * w.bits
    codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << w.bits) - 1)
    return codes.reshape(-1, words.shape[1]).t()


def dequantize_rows(
    w: DeviceIntWeight, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W's rows `rows` (int64 [R]; all when None) as [R, K] of dtype in the checkpoint's input
    order (torch ops: a token table's lookups, and the reference's layout check)."""
    codes = unpack_codes(w, rows).to(torch.float32)
    groups = torch.arange(w.in_features, device=codes.device) // w.group_size
    scales = w.scales if rows is None else w.scales[:, rows]
    offsets = w.offsets if rows is None else w.offsets[:, rows]
    values = codes * scales.t()[:, groups] + offsets.t()[:, groups]
    if w.perm is not None:
        out = torch.empty_like(values)
        out[:, w.perm] = values
        values = out
    return values.to(dtype)


def concat(parts: list[DeviceIntWeight]) -> DeviceIntWeight:
    """One weight of the parts' columns (W's rows) in order: parts of one bits, group size, input
    size and perm."""
    first = parts[0]
    if not all(joinable(first, p) for p in parts[1:]):
        raise ValueError("only int weights of one bits, group size, input size and perm join")
    return first._replace(
        qweight=torch.cat([p.qweight for p in parts], 1),
        scales=torch.cat([p.scales for p in parts], 1),
        offsets=torch.cat([p.offsets for p in parts], 1),
    )


def joinable(a: DeviceIntWeight, b: DeviceIntWeight) -> bool:
    """Whether b's rows can be appended to a's weight (concat)."""
    if (a.bits, a.group_size, a.in_features) != (b.bits, b.group_size, b.in_features):
        return False
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return a.perm is b.perm or torch.equal(a.perm, b.perm)


def gguf_to_int(w: DeviceQuantWeight) -> IntWeight:
    """A Q4_0 / Q4_1 / Q8_0 / Q4_K weight (kernels/gguf_device.py's planes) as IntWeight with
    32-column groups, equal to gguf.quants' dequantization (module note)."""
    n, k = w.out_features, w.in_features
    groups = k // 32
    if w.qtype == GGMLType.Q8_0:
        codes = (w.qs.view(n, k).to(torch.int16) + 128).to(torch.uint8)
        d = w.d.view(n, groups).to(torch.float32)
        return IntWeight(codes, d, -128.0 * d, 8, 32)
    if w.qtype not in GGUF_INT_TYPES:
        raise ValueError(f"GGUF type {w.qtype.name} is not an int weight of the Triton kernel")
    # Byte j of a group: column j in the low nibble, column j + 16 in the high one.
    qs = w.qs.view(n, groups, 16)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
    if w.qtype == GGMLType.Q4_K:
        supers = torch.arange(groups, device=qs.device) // 8
        d = w.d.view(n, -1).to(torch.float32)[:, supers]
        dmin = w.m.view(n, -1).to(torch.float32)[:, supers]
        scales = d * w.sc.view(n, groups).to(torch.float32)
        offsets = -(dmin * w.mn.view(n, groups).to(torch.float32))
        return IntWeight(codes, scales, offsets, 4, 32)
    d = w.d.view(n, groups).to(torch.float32)
    if w.qtype == GGMLType.Q4_0:
        return IntWeight(codes, d, -8.0 * d, 4, 32)
    return IntWeight(codes, d, w.m.view(n, groups).to(torch.float32), 4, 32)  # Q4_1
