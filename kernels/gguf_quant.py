"""GGUF quantized weights in the layout of the CPU kernels (kernels/cpu/quant_linear.c).

pack() turns a GGUF tensor's blocks (rows of an [N, K] weight, each a run of GGML blocks) into
32-column blocks of records, each record holding the scales of its 32 columns and then their
codes k by k, so a kernel reads the weight front to back and gets each k's 32 columns from 16
(4-bit), 20 (5-bit), 24 (6-bit) or 32 (8-bit) consecutive bytes. The bytes per weight are the
file's (the K types' 6-bit sub-block scales take a byte each).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

COLUMNS = 32  # output columns per block of the packed layout


class QuantizedWeight(NamedTuple):
    """A [out_features, in_features] weight packed for the CPU kernels."""

    qtype: GGMLType
    data: torch.Tensor  # uint8, ceil(out_features / 32) blocks
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit codes -> [..., 16] bytes: column j low, column j + 16 high."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _by_column(per_row: np.ndarray) -> np.ndarray:
    """[N, G, ...] per-row values of G groups -> [N/32, G, ..., 32]: the 32 columns of a block
    last, group by group."""
    n, groups = per_row.shape[:2]
    blocked = per_row.reshape(n // COLUMNS, COLUMNS, groups, -1).transpose(0, 2, 3, 1)
    return blocked.reshape(n // COLUMNS, groups, *per_row.shape[2:], COLUMNS)


def _codes_by_k(codes: np.ndarray, per_record: int) -> np.ndarray:
    """[N, K] codes -> [N/32, K/per_record, per_record, 32]."""
    n, k = codes.shape
    return codes.reshape(n // COLUMNS, COLUMNS, k // per_record, per_record).transpose(0, 2, 3, 1)


def _halves(blocks: np.ndarray) -> np.ndarray:
    """Bytes as fp16 pairs, kept as bytes: [..., 2] (one scale)."""
    return blocks.reshape(*blocks.shape[:-1], 2)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 16-byte nibble runs [..., 16] -> 32 codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _records(*parts: np.ndarray) -> np.ndarray:
    """Concatenate per-record byte arrays [N/32, R, ...] into [N/32, R, bytes]."""
    return np.concatenate([p.reshape(*p.shape[:2], -1) for p in parts], axis=-1)


def _pack_q4_0(blocks: np.ndarray) -> np.ndarray:
    d, qs = blocks[..., :2], blocks[..., 2:]
    codes = _nibbles(qs).reshape(blocks.shape[0], -1)
    return _records(_by_column(_halves(d)).swapaxes(-1, -2), _nibble_pairs(_codes_by_k(codes, 32)))


def _pack_q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m, qs = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:]
    codes = _nibbles(qs).reshape(blocks.shape[0], -1)
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2),
        _by_column(_halves(m)).swapaxes(-1, -2),
        _nibble_pairs(_codes_by_k(codes, 32)),
    )


def _five_bit_by_k(codes: np.ndarray, per_record: int) -> np.ndarray:
    """[N, K] 5-bit codes -> [N/32, K/per_record, per_record, 20]: 16 bytes of nibble pairs,
    then 4 bytes whose bit c is column c's high bit."""
    by_k = _codes_by_k(codes, per_record)
    high = np.packbits(by_k >> 4, axis=-1, bitorder="little")
    return np.concatenate([_nibble_pairs(by_k & 15), high], axis=-1)


def _five_bit_codes(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 blocks' codes [N, K] from their nibbles [N, B, 16] and high bits [N, B, 4]."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return (_nibbles(qs) | (bits << 4)).reshape(qs.shape[0], -1)


def _pack_q5_0(blocks: np.ndarray) -> np.ndarray:
    d, qh, qs = blocks[..., :2], blocks[..., 2:6], blocks[..., 6:]
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2), _five_bit_by_k(_five_bit_codes(qs, qh), 32)
    )


def _pack_q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m, qh, qs = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:8], blocks[..., 8:]
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2),
        _by_column(_halves(m)).swapaxes(-1, -2),
        _five_bit_by_k(_five_bit_codes(qs, qh), 32),
    )


def _pack_q8_0(blocks: np.ndarray) -> np.ndarray:
    d, qs = blocks[..., :2], blocks[..., 2:]
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2), _codes_by_k(qs.reshape(blocks.shape[0], -1), 32)
    )


def _pack_q4_k(blocks: np.ndarray) -> np.ndarray:
    n, supers = blocks.shape[:2]
    d, dmin, scales, qs = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:16], blocks[..., 16:]
    sc, mn = Q4_K.get_scale_min(scales.reshape(-1, 12))
    # 64 elements per 32 bytes: the low nibbles, then the high ones.
    codes = _nibbles(qs.reshape(n, supers, 4, 32)).reshape(n, -1)
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2),
        _by_column(_halves(dmin)).swapaxes(-1, -2),
        _by_column(sc.reshape(n, supers, 8)),
        _by_column(mn.reshape(n, supers, 8)),
        _nibble_pairs(_codes_by_k(codes, 256)),
    )


def _pack_q5_k(blocks: np.ndarray) -> np.ndarray:
    n, supers = blocks.shape[:2]
    d, dmin, scales = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:16]
    qh, qs = blocks[..., 16:48], blocks[..., 48:]
    sc, mn = Q4_K.get_scale_min(scales.reshape(-1, 12))
    low = _nibbles(qs.reshape(n, supers, 4, 32)).reshape(n, supers, 256)
    # Bit i of high byte l: element 32 i + l.
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = (low | (high.reshape(n, supers, 256) << 4)).reshape(n, -1)
    return _records(
        _by_column(_halves(d)).swapaxes(-1, -2),
        _by_column(_halves(dmin)).swapaxes(-1, -2),
        _by_column(sc.reshape(n, supers, 8)),
        _by_column(mn.reshape(n, supers, 8)),
        _five_bit_by_k(codes, 256),
    )


def _pack_q6_k(blocks: np.ndarray) -> np.ndarray:
    n, supers = blocks.shape[:2]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    scales, d = blocks[..., 192:208], blocks[..., 208:]
    # As gguf.quants.Q6_K: element (half h, row r, l) of each 128-element half.
    low = _nibbles(ql.reshape(n, supers, 2, 2, 32)).reshape(n, supers, 2, 2, 2, 32)
    low = low.transpose(0, 1, 2, 4, 3, 5).reshape(n, supers, 2, 4, 32)
    high = (qh.reshape(n, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    codes = (low | (high << 4)).reshape(n, -1)
    by_k = _codes_by_k(codes, 256)  # [N/32, supers, 256, 32]
    pairs = by_k >> 4
    high_bytes = (
        pairs[..., 0:8]
        | (pairs[..., 8:16] << 2)
        | (pairs[..., 16:24] << 4)
        | (pairs[..., 24:32] << 6)
    )
    per_k = np.concatenate([_nibble_pairs(by_k & 15), high_bytes], axis=-1)
    return _records(_by_column(_halves(d)).swapaxes(-1, -2), _by_column(scales), per_k)


_PACKERS = {
    GGMLType.Q4_0: _pack_q4_0,
    GGMLType.Q4_1: _pack_q4_1,
    GGMLType.Q5_0: _pack_q5_0,
    GGMLType.Q5_1: _pack_q5_1,
    GGMLType.Q8_0: _pack_q8_0,
    GGMLType.Q4_K: _pack_q4_k,
    GGMLType.Q5_K: _pack_q5_k,
    GGMLType.Q6_K: _pack_q6_k,
}
# The quantization types the kernels run; other GGUF types are dequantized at load.
QUANT_TYPES = frozenset(_PACKERS)


def pack(qtype: GGMLType, raw: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """The GGUF tensor raw (its bytes, [out_features, row bytes]) in the kernels' layout."""
    if qtype not in _PACKERS:
        raise ValueError(
            f"GGUF type {qtype.name} has no CPU kernel; "
            f"kernels exist for {', '.join(sorted(t.name for t in QUANT_TYPES))}"
        )
    block, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block or raw.shape != (out_features, in_features // block * type_size):
        raise ValueError(
            f"{qtype.name} tensor of {raw.shape} bytes is not an "
            f"[{out_features}, {in_features}] weight of whole blocks"
        )
    padded = -(-out_features // COLUMNS) * COLUMNS
    blocks = np.zeros((padded, in_features // block, type_size), np.uint8)
    blocks[:out_features] = raw.reshape(out_features, -1, type_size)
    packed = np.ascontiguousarray(_PACKERS[qtype](blocks)).reshape(-1)
    return QuantizedWeight(qtype, torch.from_numpy(packed), out_features, in_features)
