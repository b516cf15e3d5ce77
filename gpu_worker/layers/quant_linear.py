"""The projection of a Linear whose weight stayed GGUF-quantized: the C kernels on the CPU
(fp32 activations), the Triton ones on CUDA (activations in the model's dtype).

A fused projection (qkv, gate_up) is made of its checkpoint tensors' rows, which a GGUF file may
quantize in different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k): each run of
rows is one packed weight, and runs of one type whose boundaries fall on the kernels' 32-column
blocks are merged, so the usual case is one kernel call per projection.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import quant_linear
from kernels.gguf_device import DeviceQuantWeight, concat
from kernels.gguf_quant import COLUMNS, QuantizedWeight


def _runs(parts: list, align: int = 1) -> list[list]:
    """Consecutive parts of one type, a part joining its run only where the run's rows so far
    are a multiple of align."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        run = runs[-1]
        if run[-1].qtype == part.qtype and sum(p.out_features for p in run) % align == 0:
            run.append(part)
        else:
            runs.append([part])
    return runs


def _merge(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    runs = _runs(parts, COLUMNS)  # the C kernels' 32-column blocks must not straddle parts
    # One numpy copy per run: torch.cat copies uint8 at ~100 MB/s here (0.9-2 s of start-up
    # for the default model), numpy ten times faster.
    return [
        run[0]
        if len(run) == 1
        else QuantizedWeight(
            run[0].qtype,
            torch.from_numpy(np.concatenate([p.data.numpy() for p in run])),
            sum(p.out_features for p in run),
            run[0].in_features,
        )
        for run in runs
    ]


class _PartsProjection:
    """x @ W^T (+ bias) where W's rows are quantized parts, in order: one kernel call per part,
    each writing its columns of the output."""

    def __init__(self, parts: list, merged: list) -> None:
        """parts: the weights of W's rows in order; merged: the same rows as the weights the
        kernels run (runs of parts joined)."""
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a quantized projection needs parts with one input size")
        self.parts = merged
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _project(
        self, rows: torch.Tensor, part, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        raise NotImplementedError

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if out is None:
            out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        else:
            out = out.view(rows.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            self._project(rows, part, None if bias is None else bias[start:end], out[:, start:end])
            start = end
        return out.view(*x.shape[:-1], self.out_features)


class QuantizedProjection(_PartsProjection):
    """On the CPU: the C kernels, fp32 activations."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        super().__init__(parts, _merge(parts) if parts else [])

    def _project(
        self,
        rows: torch.Tensor,
        part: QuantizedWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        quant_linear.quant_linear(rows, part, bias, out=out)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features]."""
        return torch.cat([quant_linear.quant_dequantize(p) for p in self.parts])


class DeviceQuantizedProjection(_PartsProjection):
    """On CUDA: the Triton kernels on kernels/gguf_device.py's planes, activations in the
    model's dtype; consecutive parts of one type are one weight."""

    def __init__(self, parts: list[DeviceQuantWeight]) -> None:
        runs = _runs(parts) if parts else []  # rows of one type concatenate anywhere
        super().__init__(parts, [run[0] if len(run) == 1 else concat(run) for run in runs])
        from kernels import gguf_matmul  # Triton: imported where the weights are on CUDA

        self._kernels = gguf_matmul

    def _project(
        self,
        rows: torch.Tensor,
        part: DeviceQuantWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        self._kernels.matmul(rows, part, bias, out=out)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features]."""
        return torch.cat([self._kernels.dequantize(p) for p in self.parts])
