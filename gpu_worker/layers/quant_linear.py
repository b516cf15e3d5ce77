"""The projection of a Linear whose weight stayed GGUF-quantized (CPU, fp32 activations).

A fused projection (qkv, gate_up) is made of its checkpoint tensors' rows, which a GGUF file may
quantize in different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k): each run of
rows is one packed weight, and runs of one type whose boundaries fall on the kernels' 32-column
blocks are merged, so the usual case is one kernel call per projection.
"""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.gguf_quant import COLUMNS, QuantizedWeight


def _merge(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    merged = [parts[0]]
    for part in parts[1:]:
        last = merged[-1]
        if last.qtype == part.qtype and last.out_features % COLUMNS == 0:
            merged[-1] = QuantizedWeight(last.qtype, torch.cat([last.data, part.data]),
                                         last.out_features + part.out_features, last.in_features)
        else:
            merged.append(part)
    return merged


class QuantizedProjection:
    """x @ W^T (+ bias) where W's rows are the given quantized parts, in order."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a quantized projection needs parts with one input size")
        self.parts = _merge(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = out.view(rows.shape[0], self.out_features) if out is not None else None
        if len(self.parts) == 1:
            y = cpu_ops.quant_linear(rows, self.parts[0], bias, out=out)
            return y.view(*x.shape[:-1], self.out_features)
        if out is None:
            out = torch.empty(rows.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            cpu_ops.quant_linear(rows, part, None if bias is None else bias[start:end],
                                 out=out[:, start:end])
            start = end
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features]."""
        return torch.cat([cpu_ops.quant_dequantize(p) for p in self.parts])
