"""W kept as integer codes on CUDA (GPTQ, AWQ, compressed-tensors int, GGUF Q4_0/Q4_1/Q4_K/Q8_0):
kernels/triton/int_matmul.py on kernels/int_device.py's layout, activations in the model's dtype.

As GGUFTritonLinearMethod (quant_linear.py): W's rows are parts in order (a fused qkv or gate_up
projection's checkpoint tensors); consecutive parts of one bits, group size and perm are one
weight, so the usual case is one kernel call per projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.layers.linear_method import EmbeddingMethod, rows_and_out
from kernels.int_device import DeviceIntWeight, concat, dequantize_rows, joinable, pack_int
from kernels.quant_weights import IntWeight

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Embedding, Linear


def _runs(parts: list[DeviceIntWeight]) -> list[DeviceIntWeight]:
    runs = [[parts[0]]]
    for part in parts[1:]:
        if joinable(runs[-1][0], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else concat(run) for run in runs]


class IntTritonLinearMethod(EmbeddingMethod):
    """x @ W^T (+ bias) for W's rows given as IntWeight parts (on the CUDA device; 4 or 8 bits,
    any group size dividing in_features, perm or None)."""

    def __init__(self, parts: Sequence[IntWeight]) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a quantized projection needs parts with one input size")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.parts = _runs([pack_int(p) for p in parts])
        from kernels.triton import int_matmul  # imported where the weights are on CUDA

        self._kernels = int_matmul

    def nbytes(self, layer: Linear) -> int:
        return sum(p.nbytes for p in self.parts)

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, out = rows_and_out(x, self.in_features, self.out_features, out)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            part_bias = None if bias is None else bias[start:end]
            self._kernels.matmul(rows, part, part_bias, out=out[:, start:end])
            start = end
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features] in the checkpoint's input order."""
        return torch.cat([dequantize_rows(p) for p in self.parts])

    def check_table(self) -> None:
        if len(self.parts) != 1:
            raise ValueError(f"an embedding table is one quantized weight, not {len(self.parts)}")

    def embedding(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        table = self.parts[0]
        flat = ids.reshape(-1)
        inside = (flat >= 0) & (flat < table.out_features)
        rows = dequantize_rows(table, torch.where(inside, flat, 0), layer.dtype)
        rows = rows * inside.unsqueeze(1).to(rows.dtype)  # outside the table: zero rows
        return rows.view(*ids.shape, self.in_features)
