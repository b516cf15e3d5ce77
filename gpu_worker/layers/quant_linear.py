"""W kept GGUF-quantized: the C kernels on the CPU (fp32 activations), the Triton ones on CUDA
(activations in the model's dtype). The GGUF loader builds these methods from the packed parts.

A fused projection (qkv, gate_up) is made of its checkpoint tensors' rows, which a GGUF file may
quantize in different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k): each run of
rows is one packed weight, and runs of one type whose boundaries fall on the kernels' 32-column
blocks are merged, so the usual case is one kernel call per projection.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np
import torch

from gpu_worker.layers.linear_method import EmbeddingMethod, rows_and_out
from kernels import quant_linear
from kernels.gguf_device import DeviceQuantWeight, concat
from kernels.gguf_quant import COLUMNS, QuantizedWeight

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Embedding, Linear

Part = TypeVar("Part", QuantizedWeight, DeviceQuantWeight)


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


class GGUFLinearMethod(EmbeddingMethod, Generic[Part]):
    """x @ W^T (+ bias) where W's rows are quantized parts, in order: one kernel call per part,
    each writing its columns of the output. A token table is one part, looked up row by row."""

    def __init__(self, parts: Sequence[Part], merged: list[Part]) -> None:
        """parts: the weights of W's rows in order; merged: the same rows as the weights the
        kernels run (runs of parts joined)."""
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a quantized projection needs parts with one input size")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.parts: list[Part] = merged

    def nbytes(self, layer: Linear) -> int:
        return sum(p.nbytes for p in self.parts)

    @abstractmethod
    def _project(
        self, rows: torch.Tensor, part: Part, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """rows @ part^T (+ bias) written into out."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features]."""

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
            self._project(rows, part, None if bias is None else bias[start:end], out[:, start:end])
            start = end
        return out.view(*x.shape[:-1], self.out_features)

    def check_table(self) -> None:
        if len(self.parts) != 1:
            raise ValueError(f"an embedding table is one quantized weight, not {len(self.parts)}")


class GGUFCpuLinearMethod(GGUFLinearMethod[QuantizedWeight]):
    """On the CPU: the C kernels, fp32 activations."""

    def __init__(self, parts: Sequence[QuantizedWeight]) -> None:
        super().__init__(parts, _merge(list(parts)) if parts else [])

    def _project(
        self,
        rows: torch.Tensor,
        part: QuantizedWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        quant_linear.quant_linear(rows, part, bias, out=out)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([quant_linear.quant_dequantize(p) for p in self.parts])

    def embedding(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        return quant_linear.quant_rows(self.parts[0], ids)

    def greedy_argmax(self, x: torch.Tensor, vocab: int) -> torch.Tensor | None:
        # The fused argmax reads one packed weight, for the few-rows path's rows only.
        if len(self.parts) != 1 or not 0 < x.shape[0] <= quant_linear.quant_few_rows():
            return None
        return quant_linear.quant_linear_argmax(x, self.parts[0], vocab)

    def cpu_kernel_weight(self) -> tuple[int, torch.Tensor] | None:
        if len(self.parts) != 1:
            return None  # several types: the decode kernel reads one per projection
        return int(self.parts[0].qtype), self.parts[0].data


class GGUFTritonLinearMethod(GGUFLinearMethod[DeviceQuantWeight]):
    """On CUDA: the Triton kernels on kernels/gguf_device.py's planes, activations in the
    model's dtype; consecutive parts of one type are one weight."""

    def __init__(self, parts: Sequence[DeviceQuantWeight]) -> None:
        runs = _runs(list(parts)) if parts else []  # rows of one type concatenate anywhere
        super().__init__(parts, [run[0] if len(run) == 1 else concat(run) for run in runs])
        from kernels.triton import gguf_matmul  # imported where the weights are on CUDA

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
        return torch.cat([self._kernels.dequantize(p) for p in self.parts])

    def embedding(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        return self._kernels.dequantize(self.parts[0], ids, layer.dtype)
