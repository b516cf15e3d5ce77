"""W re-laid for the CPU after loading: for the C kernels (kernels/cpu/linear.c, swiglu) or for
the threads of a batched torch matmul."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu_worker.layers.linear_method import LinearMethod
from kernels import cpu_binding, linear
from kernels.decode_stack import F32_BLOCKED, F32_PAIRS
from kernels.linear import LINEAR_BLOCK

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Linear

# Row count from which F.linear beats the split layout plus its output copy, measured on the
# 49152 x 576 output projection (2 threads, dev box): split + copy 22.6 ms against 27.9 at 64
# rows, 38.6 against 43.9 at 128, 190 against 89 at 256.
_MANY_ROWS = 129


class BlockedLinearMethod(LinearMethod):
    """fp32 W as [out/32, in, 32] for the C kernel, which streams each thread's blocks once per
    call and, on AVX-512, runs about twice as fast as torch's matmul at every batch size."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        self.weight = linear.block_weight(weight)

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        """Whether the C kernel runs W: fp32 on the CPU, rows a multiple of its block."""
        return (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.shape[0] % LINEAR_BLOCK == 0
            and cpu_binding.available()
        )

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x is fp32: this layout is chosen only for fp32 weights, whose model runs in fp32.
        return linear.linear(x, self.weight, bias, out)

    def nbytes(self, layer: Linear) -> int:
        return self.weight.numel() * self.weight.element_size()

    def greedy_argmax(self, x: torch.Tensor, vocab: int) -> torch.Tensor | None:
        return linear.linear_argmax(x, self.weight, vocab)

    def cpu_kernel_weight(self) -> tuple[int, torch.Tensor] | None:
        return F32_BLOCKED, self.weight


class SwiGLUPairsLinearMethod(LinearMethod):
    """fp32 W = [gate; up] [2I, in] as [I/32, 2, in, 32]: each gate block beside its up block,
    so the fused SwiGLU kernel computes silu(x @ gate^T) * (x @ up^T) without writing the
    [tokens, 2I] projection (it pays with 512-bit vectors: kernels.linear.fused_swiglu_pays())."""

    def __init__(self, gate_up: torch.Tensor) -> None:
        super().__init__(gate_up.shape[1], gate_up.shape[0])
        self.weight = linear.block_weight_pairs(gate_up.detach())

    @staticmethod
    def applies(gate_up: torch.Tensor) -> bool:
        """Whether the fused kernel runs W and pays: fp32 on the CPU, gate's rows a multiple of
        its block, 512-bit vectors."""
        return (
            gate_up.dtype == torch.float32
            and gate_up.device.type == "cpu"
            and (gate_up.shape[0] // 2) % LINEAR_BLOCK == 0
            and cpu_binding.available()
            and linear.fused_swiglu_pays()
        )

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pairs = self.weight.shape[0]
        y = linear.linear(x, self.weight.view(2 * pairs, self.in_features, LINEAR_BLOCK))
        # Columns come as gate block 0, up block 0, gate block 1, ...: back to [gate | up].
        y = y.view(-1, pairs, 2, LINEAR_BLOCK).transpose(1, 2)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def nbytes(self, layer: Linear) -> int:
        return self.weight.numel() * self.weight.element_size()

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return linear.swiglu(x, self.weight)

    def cpu_kernel_weight(self) -> tuple[int, torch.Tensor] | None:
        return F32_PAIRS, self.weight


class SplitLinearMethod(LinearMethod):
    """W as [S, in, out/S] for S threads: one batched matmul gives each thread a contiguous
    slice of W to stream, which reads memory about twice as fast as MKL's single-row GEMV; for
    many rows the output copy costs more than that, and a W still held dense (tied to the
    embedding) is used as is."""

    def __init__(self, weight: torch.Tensor, splits: int) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features)
        self.weight = (
            weight.detach().t().reshape(in_features, splits, -1).transpose(0, 1).contiguous()
        )

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if layer.weight is not None and rows.shape[0] >= _MANY_ROWS:
            return F.linear(x, layer.weight, bias)
        splits = self.weight.shape[0]
        y = torch.bmm(rows.unsqueeze(0).expand(splits, -1, -1), self.weight)
        y = y.transpose(0, 1).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def nbytes(self, layer: Linear) -> int:
        return self.weight.numel() * self.weight.element_size()
