"""GGUF quantized weights in the layout of the Triton kernels (kernels/triton/gguf_matmul.py).

Every type is held as planes of row-major [N, ...] arrays, so that rows of one type concatenate
(a fused qkv or gate_up projection is one weight) and a program reads each plane contiguously:

- qs: the 4-bit low codes, 16 bytes per 32-column group, byte j holding column j in its low
  nibble and column j + 16 in its high one (GGML's own Q4_0 order; Q4_K and Q6_K, which order
  their nibbles by 64 or 128 columns, are repacked into it); Q8_0 keeps its int8 codes.
- qh: the codes' high bits, as int32 words per group: one word for the 5-bit types (bit j is
  column j's fifth bit), two for Q6_K (bits 2j, 2j + 1 of word h are column 16 h + j's).
- d, m: fp16 scales (and mins) per 32-column group; per 256-column super-block for the K types.
- sc, mn: the K types' sub-block scales and mins (uint8 per 32 columns; int8 per 16 for Q6_K).

The bytes per weight are the file's, give or take the K types' 6-bit scales (a byte each), and
the values a kernel computes from them are gguf.quants' dequantization, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

from kernels.gguf_quant import QUANT_TYPES

GROUP = 32  # columns per group of the layout
SUPER = 256  # columns per K-type super-block
# The same types as the CPU kernels run; others are dequantized at load.
DEVICE_QUANT_TYPES = QUANT_TYPES


class DeviceQuantWeight(NamedTuple):
    """A [out_features, in_features] GGUF weight as the Triton kernels' planes (unused planes
    are empty tensors on the same device)."""

    qtype: GGMLType
    qs: torch.Tensor
    qh: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        planes = (self.qs, self.qh, self.d, self.m, self.sc, self.mn)
        return sum(p.numel() * p.element_size() for p in planes)


_PLANES = ("qs", "qh", "d", "m", "sc", "mn")


def concat(parts: list[DeviceQuantWeight]) -> DeviceQuantWeight:
    """One weight of the parts' rows, in order (parts of one type and one input size)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one type and one input size concatenate")
    planes = {
        name: torch.cat([getattr(p, name).reshape(p.out_features, -1) for p in parts])
        for name in _PLANES
    }
    return first._replace(**planes, out_features=sum(p.out_features for p in parts))


def _fp16(pair: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(pair).view(np.float16)[..., 0]


def _nibble_groups(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes -> [N, K / 2] bytes: per 32 columns, byte j = column j | column j + 16 << 4."""
    n = codes.shape[0]
    groups = (codes & 15).reshape(n, -1, 2, 16)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, -1)


def _high_words(high: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] high parts of `bits` bits -> int32 words, 32 // bits columns to a word, in order."""
    n = high.shape[0]
    per_word = 32 // bits
    words = high.reshape(n, -1, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(words << shifts, axis=-1).view(np.int32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's runs of bytes [..., R] -> 2 R codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _five_bit(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes [N, B, 32] from their nibbles [N, B, 16] and high bits [N, B, 4]."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return _nibbles(qs) | (bits << 4)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-block scale and min (fp16 [N, S]) and sub-block ones (uint8 [N, 8 S])."""
    n, supers = blocks.shape[:2]
    sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    return (
        _fp16(blocks[..., 0:2]),
        _fp16(blocks[..., 2:4]),
        sc.reshape(n, supers * 8).astype(np.uint8),
        mn.reshape(n, supers * 8).astype(np.uint8),
    )


def _planes(qtype: GGMLType, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """The planes of blocks ([N, B, type size] bytes of one type) as numpy arrays."""
    n, nblocks = blocks.shape[:2]
    if qtype == GGMLType.Q8_0:
        return {"qs": blocks[..., 2:].view(np.int8).reshape(n, -1), "d": _fp16(blocks[..., :2])}
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        skip = 2 if qtype == GGMLType.Q4_0 else 4
        planes = {"qs": blocks[..., skip:].reshape(n, -1), "d": _fp16(blocks[..., :2])}
        if qtype == GGMLType.Q4_1:
            planes["m"] = _fp16(blocks[..., 2:4])
        return planes
    if qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
        at = 2 if qtype == GGMLType.Q5_0 else 4
        codes = _five_bit(blocks[..., at + 4 :], blocks[..., at : at + 4]).reshape(n, -1)
        planes = {
            "qs": _nibble_groups(codes),
            "qh": _high_words(codes >> 4, 1),
            "d": _fp16(blocks[..., :2]),
        }
        if qtype == GGMLType.Q5_1:
            planes["m"] = _fp16(blocks[..., 2:4])
        return planes
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin, sc, mn = _k_scales(blocks)
        qs = blocks[..., -128:]
        # 64 columns per 32 bytes: the low nibbles, then the high ones.
        codes = _nibbles(qs.reshape(n, nblocks, 4, 32)).reshape(n, nblocks, 256)
        planes = {"d": d, "m": dmin, "sc": sc, "mn": mn}
        if qtype == GGMLType.Q5_K:
            qh = blocks[..., 16:48]
            # Bit i of high byte l: column 32 i + l.
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = codes | (high.reshape(n, nblocks, 256) << 4)
            planes["qh"] = _high_words(codes.reshape(n, -1) >> 4, 1)
        planes["qs"] = _nibble_groups(codes.reshape(n, -1))
        return planes
    if qtype == GGMLType.Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        # As gguf.quants.Q6_K: column (half h, row r, l) of each 128-column half.
        low = _nibbles(ql.reshape(n, nblocks, 2, 2, 32)).reshape(n, nblocks, 2, 2, 2, 32)
        low = low.transpose(0, 1, 2, 4, 3, 5).reshape(n, nblocks, 2, 4, 32)
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        high = (qh.reshape(n, nblocks, 2, 1, 32) >> shifts) & 3
        codes = (low | (high << 4)).reshape(n, -1)
        return {
            "qs": _nibble_groups(codes),
            "qh": _high_words(codes >> 4, 2),
            "d": _fp16(blocks[..., 208:210]),
            "sc": blocks[..., 192:208].view(np.int8).reshape(n, -1),
        }
    raise ValueError(
        f"GGUF type {qtype.name} has no Triton kernel; kernels exist for "
        f"{', '.join(sorted(t.name for t in DEVICE_QUANT_TYPES))}"
    )


def pack_device(
    qtype: GGMLType, raw: np.ndarray, out_features: int, in_features: int, device: torch.device
) -> DeviceQuantWeight:
    """The GGUF tensor raw (its bytes, [out_features, row bytes]) as the Triton kernels' planes
    on device."""
    if qtype not in DEVICE_QUANT_TYPES:
        _planes(qtype, raw)  # raises, naming the types that have kernels
    block, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block or raw.shape != (out_features, in_features // block * type_size):
        raise ValueError(
            f"{qtype.name} tensor of {raw.shape} bytes is not an "
            f"[{out_features}, {in_features}] weight of whole blocks"
        )
    planes = _planes(qtype, raw.reshape(out_features, -1, type_size))
    empty = torch.empty(out_features, 0, dtype=torch.uint8, device=device)

    def plane(name: str) -> torch.Tensor:
        if name not in planes:
            return empty
        array = np.ascontiguousarray(planes[name]).reshape(out_features, -1)
        return torch.from_numpy(array).to(device)

    return DeviceQuantWeight(qtype, *(plane(p) for p in _PLANES), out_features, in_features)
