"""GPTQ and AWQ weights (IntWeight) on the CPU through the GGUF C kernels (kernels/cpu/
quant_linear.c), fp32 activations.

Each part is converted at load into the most compact GGUF type that dequantizes to the same W
bit for bit (kernels/int_to_gguf.py: symmetric 4-bit is Q4_0, asymmetric 4-bit Q5_0, symmetric
8-bit Q8_0), so results are the dequantized model's up to the order of the sums. An act-order
part's inputs are gathered once per step (x[..., perm]) and shared by the consecutive parts
with the same perm (a fused projection's usually share one).

Where no GGUF type holds a part exactly (scales not exact in fp16, offsets that are neither
integer zero points nor fp16 values, 8-bit codes whose code - zero leaves int8, groups not whole
32-input blocks), that part runs as its dequantized fp32 W through torch's matmul: exact, at
four bytes a weight, with a warning naming the reason. Never an inexact conversion.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from gpu_worker.layers.linear_method import LinearMethod, rows_and_out
from gpu_worker.layers.quant_linear import GGUFCpuLinearMethod
from kernels.gguf_quant import QuantizedWeight
from kernels.int_to_gguf import NoExactGGUF, int_to_gguf
from kernels.quant_weights import IntWeight

if TYPE_CHECKING:
    from gpu_worker.layers.linear import Linear

logger = logging.getLogger(__name__)
_warned: set[str] = set()


class _Run(NamedTuple):
    """Output columns start:end of W, computed from x (perm None) or from x[..., perm]."""

    start: int
    end: int
    perm: int | None  # index into IntCpuLinearMethod.perms
    kernel: GGUFCpuLinearMethod | torch.Tensor  # packed parts, or a dense fp32 [end - start, K]


class IntCpuLinearMethod(LinearMethod):
    """x @ W^T (+ bias) for W's rows given as IntWeight parts in order, on the CPU."""

    def __init__(self, parts: Sequence[IntWeight]) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("an int quantized projection needs parts with one input size")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.perms: list[torch.Tensor] = []  # int64 [K] each, distinct
        # Each part as (its perm's index, its packed weight) or (None, its dense W).
        held: list[tuple[int | None, QuantizedWeight | torch.Tensor]] = []
        for part in parts:
            try:
                packed = int_to_gguf(part.codes, part.scales, part.offsets, part.group_size)
            except NoExactGGUF as e:
                _warn_dense(part, str(e))
                held.append((None, part.dequantize()))
                continue
            held.append((None if part.perm is None else self._perm_index(part.perm), packed))
        self.runs: list[_Run] = []
        start = 0
        for perm, weights in _consecutive(held):
            end = start + sum(
                w.shape[0] if isinstance(w, torch.Tensor) else w.out_features for w in weights
            )
            kernel: GGUFCpuLinearMethod | torch.Tensor
            if isinstance(weights[0], torch.Tensor):
                kernel = torch.cat(weights)  # type: ignore[arg-type]
            else:
                kernel = GGUFCpuLinearMethod(weights)  # type: ignore[arg-type]
            self.runs.append(_Run(start, end, perm, kernel))
            start = end

    def _perm_index(self, perm: torch.Tensor) -> int:
        for i, known in enumerate(self.perms):
            if known is perm or torch.equal(known, perm):
                return i
        self.perms.append(perm.to(device="cpu", dtype=torch.int64).contiguous())
        return len(self.perms) - 1

    def apply(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, out = rows_and_out(x, self.in_features, self.out_features, out)
        gathered = [rows.index_select(1, perm) for perm in self.perms]  # one gather per perm
        for run in self.runs:
            src = rows if run.perm is None else gathered[run.perm]
            dst = out[:, run.start : run.end]
            run_bias = None if bias is None else bias[run.start : run.end]
            if isinstance(run.kernel, torch.Tensor):
                dst.copy_(F.linear(src, run.kernel, run_bias))
            else:
                run.kernel.apply(layer, src, run_bias, dst)
        return out.view(*x.shape[:-1], self.out_features)

    def nbytes(self, layer: Linear) -> int:
        held = sum(
            r.kernel.numel() * r.kernel.element_size()
            if isinstance(r.kernel, torch.Tensor)
            else r.kernel.nbytes(layer)
            for r in self.runs
        )
        return held + sum(p.numel() * p.element_size() for p in self.perms)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out_features, in_features] in the checkpoint's input order, from the
        weights the kernels read."""
        out = torch.empty(self.out_features, self.in_features)
        for run in self.runs:
            w = run.kernel if isinstance(run.kernel, torch.Tensor) else run.kernel.dequantize()
            if run.perm is None:
                out[run.start : run.end] = w
            else:
                out[run.start : run.end, self.perms[run.perm]] = w
        return out

    def _single(self) -> GGUFCpuLinearMethod | None:
        """The one packed run where W is one, in the inputs' order."""
        if len(self.runs) != 1 or self.runs[0].perm is not None:
            return None
        kernel = self.runs[0].kernel
        return None if isinstance(kernel, torch.Tensor) else kernel

    def greedy_argmax(self, x: torch.Tensor, vocab: int) -> torch.Tensor | None:
        single = self._single()
        return None if single is None else single.greedy_argmax(x, vocab)

    def cpu_kernel_weight(self) -> tuple[int, torch.Tensor] | None:
        single = self._single()
        return None if single is None else single.cpu_kernel_weight()


def _consecutive(
    held: list[tuple[int | None, QuantizedWeight | torch.Tensor]],
) -> list[tuple[int | None, list]]:
    """Runs of consecutive parts read from the same inputs and held alike (packed or dense)."""
    runs: list[tuple[int | None, list]] = []
    for perm, weight in held:
        dense = isinstance(weight, torch.Tensor)
        if runs and runs[-1][0] == perm and isinstance(runs[-1][1][0], torch.Tensor) == dense:
            runs[-1][1].append(weight)
        else:
            runs.append((perm, [weight]))
    return runs


def _warn_dense(part: IntWeight, reason: str) -> None:
    kind = re.sub(r"-?\d+", "#", reason)  # once per reason, whatever its figures
    if kind not in _warned:
        _warned.add(kind)
        logger.warning(
            "a %d-bit [%d, %d] weight runs dequantized in fp32 on the CPU: %s",
            part.bits,
            part.out_features,
            part.in_features,
            reason,
        )
