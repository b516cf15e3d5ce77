"""Quantized linear weights in the engine's two canonical forms, whatever checkpoint format they
came from (GPTQ, AWQ, compressed-tensors, ModelOpt, FBGEMM, a GGUF type), with the dequantization
every kernel is checked against.

IntWeight: integer codes with a scale and an offset per group of input features,
    W[n, k] = scales[n, k // group_size] * codes[n, k] + offsets[n, k // group_size]
in the order the kernels read the inputs. An act-order (desc_act) GPTQ checkpoint quantized the
inputs in another order: its groups are made contiguous by permuting the inputs (perm), so the
kernels read x[..., perm] and W in that order; dequantize() gives W in the checkpoint's input
order, the reference. GPTQ's and AWQ's integer zero points z become offsets = -scales * z,
exact in fp32 (an fp16 scale times a small integer).

Fp8Weight: float8 e4m3 values with a scale per output row, W[n, k] = weight[n, k] * scale[n]
(a per-tensor scale is repeated per row: exact), and the activations' static scale, if the
checkpoint has one (else activations get a scale per token at run time).

A LinearMethod built on these holds W as one or several parts in row order (a fused qkv or
gate_up projection's checkpoint tensors), as GGUFLinearMethod does (gpu_worker/layers/).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


class IntWeight(NamedTuple):
    """A [out_features, in_features] weight of bits-wide integer codes, grouped along k."""

    codes: torch.Tensor  # uint8 [N, K], each in [0, 2**bits), inputs in perm's order
    scales: torch.Tensor  # float32 [N, K // group_size]
    offsets: torch.Tensor  # float32 [N, K // group_size]
    bits: int  # 4 or 8
    group_size: int  # inputs per group; K for one group per row (per-channel)
    perm: torch.Tensor | None = None  # int64 [K]: kernel input i is checkpoint input perm[i]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [N, K] in the checkpoint's input order: the reference of every kernel."""
        n, k = self.codes.shape
        groups = k // self.group_size
        codes = self.codes.to(torch.float32).view(n, groups, self.group_size)
        w = (codes * self.scales.unsqueeze(-1) + self.offsets.unsqueeze(-1)).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def zero_points(self) -> torch.Tensor | None:
        """The integer zero points z (offsets == -scales * z), float32 [N, groups], where every
        group has one (GPTQ, AWQ, round-to-nearest); None where an offset is not an integer
        multiple of its scale (GGUF's K-type minimums)."""
        safe = torch.where(self.scales == 0, torch.ones_like(self.scales), self.scales)
        z = -self.offsets / safe
        z = torch.where(self.scales == 0, torch.zeros_like(z), z)
        exact = (z == z.round()) & (-self.scales * z.round() == self.offsets)
        return z.round() if bool(exact.all()) else None


class Fp8Weight(NamedTuple):
    """A [out_features, in_features] float8 e4m3 weight with a scale per output row."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    input_scale: torch.Tensor | None = None  # float32 scalar: static activation scale

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [N, K]: the reference (and the weight-only path's dense weight)."""
        return self.weight.to(torch.float32) * self.scale.to(torch.float32).unsqueeze(1)


def quantize_int(weight: torch.Tensor, bits: int = 4, group_size: int = 128) -> IntWeight:
    """Round-to-nearest asymmetric quantization of a dense [N, K] weight (--quantization on a
    dense checkpoint, dummy quantized weights for benchmarks): per group, the scale spans the
    group's range in 2**bits - 1 steps and the zero point is an integer, as GPTQ stores them."""
    n, k = weight.shape
    if group_size <= 0 or group_size > k:
        group_size = k
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    levels = (1 << bits) - 1
    w = weight.detach().to(torch.float32).view(n, k // group_size, group_size)
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    scales = ((hi - lo) / levels).to(torch.float16).to(torch.float32)  # stored as fp16
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = (-lo / scales).round().clamp(0, levels)
    codes = (w / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, levels)
    return IntWeight(
        codes.to(torch.uint8).view(n, k), scales, -scales * zeros, bits, group_size, None
    )


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> Fp8Weight:
    """A dense [N, K] weight as float8 e4m3 with a scale per row (per_channel) or one for the
    tensor (--quantization fp8 on a dense checkpoint)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale.contiguous(), None)


def concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """One weight of the parts' rows, in order; the activations' static scale is the largest
    of the parts' (the parts share their input: a fused qkv or gate_up)."""
    scales = [p.input_scale for p in parts if p.input_scale is not None]
    if scales and len(scales) != len(parts):
        raise ValueError("a fused projection mixes static and dynamic activation scales")
    return Fp8Weight(
        torch.cat([p.weight for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.stack(scales).max() if scales else None,
    )
