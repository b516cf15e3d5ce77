"""GGUF-quantized matmuls of the CPU path (kernels/cpu/quant_linear.c) over weights packed by
kernels.gguf_quant.pack(): x @ W^T, fused with an argmax for a few rows, the weight dequantized,
and rows of it (an embedding lookup). Activations fp32. C only: on CUDA, kernels.triton.gguf_matmul
runs the same weights in kernels.gguf_device's layout.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_binding import as_matrix, check_bias, check_cpu, library
from kernels.gguf_quant import QuantizedWeight
from kernels.linear import LINEAR_BLOCK


@functools.cache
def _block_bytes(qtype: int, in_features: int) -> int:
    return library().quant_block_bytes(qtype, in_features)


def _check_quantized(weight: QuantizedWeight) -> None:
    """The packed bytes are the size the kernel will read for this type and shape."""
    block_bytes = _block_bytes(weight.qtype, weight.in_features)
    blocks = -(-weight.out_features // LINEAR_BLOCK)
    data = weight.data
    if (
        not block_bytes
        or data.dtype != torch.uint8
        or not data.is_cpu
        or not data.is_contiguous()
        or data.numel() != blocks * block_bytes
    ):
        raise ValueError(
            f"{weight.qtype.name} weight [{weight.out_features}, "
            f"{weight.in_features}]: {data.numel()} packed bytes do not match the "
            f"kernel's layout"
        )


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for a weight packed by kernels.gguf_quant.pack(); returns
    [..., N], written into out ([M, N], rows any stride, columns packed) when given."""
    check_cpu(x, "x")
    _check_quantized(weight)
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {k} inputs")
    check_bias(bias, n)
    # Called per layer per step: the common 2-D packed case skips the reshapes.
    rows = x if x.dim() == 2 and x.stride(1) == 1 else as_matrix(x, k)
    m = rows.shape[0]
    if out is None:
        out = torch.empty(m, n)
    else:
        check_cpu(out, "out")
        if out.shape != (m, n) or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out {tuple(out.shape)} is not [{m}, {n}] with packed columns")
    if m:
        library().quant_linear_f32(
            weight.qtype,
            rows.data_ptr(),
            rows.stride(0),
            weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            m,
            k,
            n,
            torch.get_num_threads(),
        )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


@functools.cache
def quant_few_rows() -> int:
    """The rows quant_linear_argmax() takes at most (the few-rows path's, 2 with 256-bit
    vectors, 4 with 512-bit ones); asked of the library once (it is checked every step)."""
    return int(library().quant_few_rows())


def quant_linear_argmax(x: torch.Tensor, weight: QuantizedWeight, vocab: int) -> torch.Tensor:
    """argmax over the first `vocab` columns of x [M, K] @ W^T per row, [M] int64, for M up to
    quant_few_rows(), without writing the logits; the index quant_linear() and argmax_rows()
    give."""
    check_cpu(x, "x")
    _check_quantized(weight)
    k = weight.in_features
    if x.dim() != 2 or x.shape[1] != k or not 0 < vocab <= weight.out_features:
        raise ValueError(
            f"x {tuple(x.shape)} / vocab {vocab} do not match the quantized weight "
            f"[{weight.out_features}, {k}]"
        )
    if not 0 < x.shape[0] <= quant_few_rows():
        raise ValueError(f"{x.shape[0]} rows: the fused argmax takes 1 to {quant_few_rows()}")
    rows = as_matrix(x, k)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    library().quant_linear_argmax_f32(
        int(weight.qtype),
        rows.data_ptr(),
        rows.stride(0),
        weight.data.data_ptr(),
        rows.shape[0],
        k,
        weight.out_features,
        vocab,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def quant_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The packed weight as fp32 [N, K]."""
    _check_quantized(weight)
    out = torch.empty(weight.out_features, weight.in_features)
    library().quant_dequantize_f32(
        int(weight.qtype),
        weight.data.data_ptr(),
        out.data_ptr(),
        weight.in_features,
        weight.in_features,
        weight.out_features,
        torch.get_num_threads(),
    )
    return out


def quant_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids (int64, any shape) of the packed weight as fp32 [*ids.shape, K]: an embedding
    lookup on a quantized table."""
    _check_quantized(weight)
    check_cpu(ids, "ids", torch.int64)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty(*ids.shape, weight.in_features)
    rc = library().quant_rows_f32(
        weight.qtype,
        weight.data.data_ptr(),
        weight.in_features,
        weight.out_features,
        flat.data_ptr(),
        flat.numel(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -3:
        raise IndexError(f"ids outside the table's {weight.out_features} rows")
    return out
