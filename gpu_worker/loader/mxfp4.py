"""MXFP4 weights (the OCP microscaling format gpt-oss's official checkpoints ship their experts
in), dequantized at load: there is no 4-bit kernel here, so the experts are held and run in the
model's dtype.

A tensor comes as two: `<name>_blocks` uint8 [..., G, 16], each byte two e2m1 (fp4) values, the
low nibble first; `<name>_scales` uint8 [..., G], one e8m0 exponent per block of 32 values
(2 ** (scale - 127)). Row r of the dequantized [..., G * 32] tensor is its G blocks in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The 16 e2m1 values by nibble: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _MAGNITUDES + tuple(-v for v in _MAGNITUDES)
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in dtype, on blocks'
    device. Exact in float32 and bfloat16 (an fp4 value times a power of two). Raises
    ValueError where the shapes do not pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            f"(blocks [..., G, {BLOCK // 2}], scales [..., G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    # Each byte's two values at once (low nibble first): one lookup in a [256, 2] table.
    codes = torch.arange(256, device=blocks.device)
    pairs = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)
    values = F.embedding(blocks.int(), pairs).flatten(-2)  # [..., G, 32]
    # 2 ** (scale - 127) is exact in fp32 (2**-127 a subnormal; 255, e8m0's NaN, reads inf).
    scale = torch.exp2(scales.to(device=blocks.device, dtype=torch.float32) - SCALE_BIAS)
    return (values * scale.unsqueeze(-1)).flatten(-2).to(dtype)
