"""Linear and embedding layers whose weights start uninitialized (the loader fills them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.quant_linear import DeviceQuantizedProjection, QuantizedProjection
from kernels import cpu_binding, quant_linear
from kernels import linear as cpu_linear
from kernels.gguf_device import DeviceQuantWeight
from kernels.gguf_quant import QuantizedWeight

# Row count from which F.linear beats the split layout plus its output copy, measured on the
# 49152 x 576 output projection (2 threads, dev box): split + copy 22.6 ms against 27.9 at 64
# rows, 38.6 against 43.9 at 128, 190 against 89 at 256.
_MANY_ROWS = 129


class Linear(nn.Module):
    """y = x @ W^T (+ b); W is [out_features, in_features] as in Hugging Face checkpoints.

    On CPU in fp32, use_blocked_layout() re-lays W as [out/32, in, 32] for the C kernel
    (kernels/cpu/linear.c), which streams each thread's blocks once per call and, on AVX-512,
    runs about twice as fast as torch's matmul at every batch size. Otherwise
    use_split_layout() re-lays W as [S, in, out/S] for S threads: one batched matmul then gives
    each thread a contiguous slice of W to stream, which reads memory about twice as fast as
    MKL's single-row GEMV and is no slower for large batches. A weight the loader kept
    GGUF-quantized (use_quantized()) runs the quantized kernels instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.split_weight: torch.Tensor | None = None
        self.blocked_weight: torch.Tensor | None = None
        self.quantized: QuantizedProjection | DeviceQuantizedProjection | None = None

    def use_quantized(self, parts: list[QuantizedWeight] | list[DeviceQuantWeight]) -> None:
        """Run on W given as quantized row runs (in order; CPU or CUDA layout) and drop the
        dense W (a tied embedding keeps its own reference)."""
        projection: QuantizedProjection | DeviceQuantizedProjection
        if all(isinstance(p, DeviceQuantWeight) for p in parts):
            projection = DeviceQuantizedProjection(parts)  # type: ignore[arg-type]
        else:
            projection = QuantizedProjection(parts)  # type: ignore[arg-type]
        if (
            projection.out_features != self.weight.shape[0]
            or projection.in_features != self.weight.shape[1]
        ):
            raise ValueError(
                f"quantized weight [{projection.out_features}, "
                f"{projection.in_features}] does not fit {tuple(self.weight.shape)}"
            )
        self.quantized = projection
        self.weight = None

    def use_blocked_layout(self) -> bool:
        """Switch to the C kernel's layout; False (nothing changed) where it does not apply."""
        weight = self.weight
        if (
            weight is None
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or weight.shape[0] % cpu_linear.LINEAR_BLOCK
            or not cpu_binding.available()
        ):
            return False
        self.blocked_weight = cpu_linear.block_weight(weight)
        return True

    def use_split_layout(self, splits: int) -> None:
        """Switch to the [splits, in, out/splits] layout (CPU only; out must divide evenly)."""
        if self.weight is None:  # already re-laid by the module that owns it
            return
        out_features, in_features = self.weight.shape
        if out_features % splits:
            return
        self.split_weight = (
            self.weight.detach().t().reshape(in_features, splits, -1).transpose(0, 1).contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(
        self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ W^T + bias in whichever layout W is held. out, a contiguous fp32 buffer of the
        result's shape, receives the result where the C kernels compute it (use the return)."""
        if self.quantized is not None:
            return self.quantized(x, bias, out)
        if self.blocked_weight is not None and x.dtype == torch.float32:
            return cpu_linear.linear(x, self.blocked_weight, bias, out)
        rows = x.reshape(-1, x.shape[-1])
        # With many rows the split layout's output transpose costs more than it saves; use W
        # itself when it is still held (a weight tied to the embedding is).
        if self.split_weight is None or (self.weight is not None and rows.shape[0] >= _MANY_ROWS):
            return F.linear(x, self.weight, bias)
        splits = self.split_weight.shape[0]
        y = torch.bmm(rows.unsqueeze(0).expand(splits, -1, -1), self.split_weight)
        y = y.transpose(0, 1).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; a table the loader kept GGUF-quantized
    (use_quantized()) is looked up row by row in its packed form (dequantized to the model's
    dtype on CUDA)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quantized: QuantizedWeight | DeviceQuantWeight | None = None

    def use_quantized(self, table: QuantizedWeight | DeviceQuantWeight) -> None:
        """Look rows up in the packed table and drop the dense one."""
        if (table.out_features, table.in_features) != tuple(self.weight.shape):
            raise ValueError(
                f"quantized table [{table.out_features}, {table.in_features}] does "
                f"not fit {tuple(self.weight.shape)}"
            )
        self.dtype = self.weight.dtype
        self.quantized = table
        self.weight = None
        if isinstance(table, DeviceQuantWeight):
            from kernels import gguf_matmul  # Triton: imported where the table is on CUDA

            self._device_rows = gguf_matmul.dequantize

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, DeviceQuantWeight):
            return self._device_rows(self.quantized, ids, self.dtype)
        if self.quantized is not None:
            return quant_linear.quant_rows(self.quantized, ids)
        return F.embedding(ids, self.weight)


def use_cpu_layout(model: nn.Module, threads: int) -> None:
    """Re-lay every Linear of a loaded model for fast CPU matmuls; frees the old layout.

    The C kernel's blocked layout where it applies; else the split layout, which a module (the
    MLP) may apply to its children itself."""
    blocked = cpu_binding.available() and next(model.parameters()).dtype == torch.float32
    for module in model.modules():  # parents first: a module may re-lay its children itself
        if isinstance(module, Linear):
            if not module.use_blocked_layout():
                module.use_split_layout(threads)
            relaid = module.blocked_weight is not None or module.split_weight is not None
            if relaid and not _shared(module, model):
                module.weight = None
        elif blocked and hasattr(module, "use_fused_swiglu"):
            module.use_fused_swiglu()
        elif hasattr(module, "use_split_layout") and not blocked:
            module.use_split_layout(threads)


def _shared(linear: Linear, model: nn.Module) -> bool:
    """True when the Linear's weight is also used elsewhere (tied embeddings)."""
    return any(
        m is not linear and getattr(m, "weight", None) is linear.weight for m in model.modules()
    )
