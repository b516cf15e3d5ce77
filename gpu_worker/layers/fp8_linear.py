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

Where an RMSNorm feeds the projection (a DecoderLayer's input_layernorm -> qkv_proj,
post_attention_layernorm -> gate_up_proj), the W8A8 path's quantization runs in the norm's
kernel instead (norm_and_quantize, kernels/triton/rms_norm_quant.py): the layer then gets an
Fp8Activation, the fp8 codes and their scales, as its x.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from gpu_worker.layers.linear_method import LinearMethod
from kernels.quant_weights import Fp8Weight, concat_fp8

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Linear
    from gpu_worker.layers.norm import RMSNorm


class Fp8Activation(NamedTuple):
    """A W8A8 projection's input already quantized (by the norm before it): q float8_e4m3fn
    [M, K] and scale fp32 [M, 1] with x ~= q * scale per row; shape and dtype: x's, which the
    projection's output takes ([..., out_features], dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


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
            from kernels.triton import fp8_quant, rms_norm_quant  # where the weights are on CUDA

            self._quant = fp8_quant
            self._norm_quant = rms_norm_quant
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

    def norm_and_quantize(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[Fp8Activation, torch.Tensor]:
        """(this projection's input norm(x + residual) quantized as the W8A8 path would, x +
        residual) in one kernel; residual is updated in place (None: x is normed and returned
        as the residual, the first layer's case). x and residual: [M, K], unit column stride."""
        if not self.w8a8:
            raise ValueError("only the W8A8 path takes quantized activations")
        q, scale = self._norm_quant.rms_norm_quant(
            x, residual, norm.weight, norm.eps, self.input_scale
        )
        return Fp8Activation(q, scale, x.shape, x.dtype), x if residual is None else residual

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor | Fp8Activation,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return self._apply_quantized(x, bias, out)
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

    def _apply_quantized(
        self, x: Fp8Activation, bias: torch.Tensor | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        if not self.w8a8 or x.q.shape[-1] != self.in_features:
            raise ValueError(
                f"quantized activations [.., {x.q.shape[-1]}] need the W8A8 path with "
                f"{self.in_features} inputs"
            )
        rows = x.q.shape[0]
        if rows:
            y = self._scaled_mm(x.q, x.scale, bias, x.dtype)
        else:
            y = torch.empty(0, self.out_features, dtype=x.dtype, device=x.q.device)
        if out is not None:
            out.view(rows, self.out_features).copy_(y)
        return y.view(*x.shape[:-1], self.out_features)

    def _w8a8(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale_a = self._quant.quantize_per_token(rows, self.input_scale)
        return self._scaled_mm(q, scale_a, bias, rows.dtype)

    def _scaled_mm(
        self,
        q: torch.Tensor,
        scale_a: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        assert self.weight is not None
        y = torch._scaled_mm(
            q,
            self.weight.weight.t(),
            scale_a=scale_a,
            scale_b=self.scale_b,
            out_dtype=torch.bfloat16,  # rowwise scaling's output type
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y if dtype == y.dtype else y.to(dtype)
