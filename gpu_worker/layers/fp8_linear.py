"""W kept as float8 e4m3 on CUDA (FP8 checkpoints, --quantization fp8): W8A8 on FP8 tensor cores,
else weight-only.

W8A8 (compute capability 8.9 and above): each step quantizes x per token on the device
(kernels/triton/fp8_quant.py; a checkpoint's static input scale instead where it has one) and
torch._scaled_mm multiplies the fp8 operands with rowwise scaling (x's scale per row, W's per
output feature), fp32 accumulation, bf16 out. No host syncs: graph-capturable.

Weight-only (older GPUs, W8A16 checkpoints): W dequantized once into the activations' dtype,
then a dense matmul: the fp8 checkpoint's memory on disk, the dense model's speed and bytes.
The dtype is the model's, given at construction or taken from the first activations (the
warm-up step, before any graph capture).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.layers.linear_method import LinearMethod
from gpu_worker.layers.quant_weights import Fp8Weight, concat_fp8

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Linear


def fp8_w8a8_supported(device: torch.device) -> bool:
    """Whether device has FP8 tensor cores (CUDA compute capability 8.9: Ada, Hopper, later)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_shape_ok(out_features: int, in_features: int) -> bool:
    """torch._scaled_mm's constraint on W: both dimensions multiples of 16."""
    return out_features % 16 == 0 and in_features % 16 == 0


class Fp8LinearMethod(LinearMethod):
    """x @ W^T (+ bias) for W's rows given as Fp8Weight parts in order (one weight: the parts
    concatenate, concat_fp8). w8a8: the FP8 tensor-core path; False: weight-only."""

    def __init__(
        self, parts: Sequence[Fp8Weight], w8a8: bool, dtype: torch.dtype | None = None
    ) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("an fp8 projection needs parts with one input size")
        weight = parts[0] if len(parts) == 1 else concat_fp8(list(parts))
        super().__init__(weight.in_features, weight.out_features)
        # _scaled_mm needs dimensions of 16: other shapes (none in the usual models) weight-only.
        self.w8a8 = w8a8 and scaled_mm_shape_ok(weight.out_features, weight.in_features)
        self.weight: Fp8Weight | None = weight
        self.dense: torch.Tensor | None = None  # weight-only: W [N, K] in the model's dtype
        if self.w8a8:
            # The [K, N] column-major operand _scaled_mm wants is W's transpose view.
            weight = weight._replace(weight=weight.weight.contiguous())
            self.weight = weight
            self.scale_b = weight.scale.to(torch.float32).reshape(1, -1).contiguous()
            self.input_scale = (
                None
                if weight.input_scale is None
                else weight.input_scale.to(torch.float32).reshape(1)
            )
            from kernels.triton import fp8_quant  # imported where the weights are on CUDA

            self._quant = fp8_quant
        elif dtype is not None:
            self._dequantize(dtype)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.dense is None:
            assert self.weight is not None
            self.dense = self.weight.dequantize().to(dtype)
            self.weight = None  # the fp8 copy is not read again
        elif self.dense.dtype != dtype:
            raise ValueError(
                f"fp8 weight-only W was dequantized to {self.dense.dtype}; "
                f"activations in {dtype} are not supported"
            )
        return self.dense

    def nbytes(self, layer: Linear) -> int:
        n, k = self.out_features, self.in_features
        if self.w8a8:
            return n * k + 4 * n
        size = 2 if self.dense is None else self.dense.element_size()  # the model's dtype
        return n * k * size

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.w8a8 and rows.shape[0]:
            y = self._w8a8(rows, bias)
        elif self.w8a8:  # no rows: nothing to quantize
            y = rows.new_empty(0, self.out_features)
        else:
            weight = self._dequantize(x.dtype)
            y = torch.nn.functional.linear(rows, weight, bias)
        if out is not None:
            out.view(rows.shape[0], self.out_features).copy_(y)
        return y.view(*x.shape[:-1], self.out_features)

    def _w8a8(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.weight is not None
        q, scale_a = self._quant.quantize_per_token(rows, self.input_scale)
        y = torch._scaled_mm(
            q,
            self.weight.weight.t(),
            scale_a=scale_a,
            scale_b=self.scale_b,
            out_dtype=torch.bfloat16,  # rowwise scaling's output type
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y if rows.dtype == y.dtype else y.to(rows.dtype)
