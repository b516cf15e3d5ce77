"""The blocked fp32 GEMMs of the CPU path (kernels/cpu/linear.c): x @ W^T over a weight re-laid
in 32-column blocks, fused with an argmax over the columns (greedy sampling without the logits)
or with SwiGLU over a paired gate/up weight. C only: on other devices the layers run torch's
matmul.
"""

from __future__ import annotations

import torch

from kernels.cpu_binding import as_matrix, check_bias, check_cpu, library

# Columns per weight block of linear() (kernels/cpu/linear.c).
LINEAR_BLOCK = 32


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the layout linear() reads, [N/32, K, 32] (N a multiple of 32)."""
    check_cpu(weight, "weight")
    out_features, in_features = weight.shape
    if out_features % LINEAR_BLOCK:
        raise ValueError(f"out_features {out_features} is not a multiple of {LINEAR_BLOCK}")
    return (
        weight.detach()
        .t()
        .reshape(in_features, out_features // LINEAR_BLOCK, LINEAR_BLOCK)
        .transpose(0, 1)
        .contiguous()
    )


def linear(
    x: torch.Tensor,
    weight_blocked: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W given by block_weight(); returns [..., N], written into
    out (contiguous, [..., N]) when given."""
    check_cpu(x, "x")
    check_cpu(weight_blocked, "weight_blocked")
    blocks, in_features, width = weight_blocked.shape
    if width != LINEAR_BLOCK or not weight_blocked.is_contiguous() or x.shape[-1] != in_features:
        raise ValueError(
            f"x {tuple(x.shape)} does not match the blocked weight {tuple(weight_blocked.shape)}"
        )
    out_features = blocks * LINEAR_BLOCK
    check_bias(bias, out_features)
    rows = as_matrix(x, in_features)
    if out is None:
        out = torch.empty(*x.shape[:-1], out_features)
    else:
        check_cpu(out, "out")
        if out.shape != (*x.shape[:-1], out_features) or not out.is_contiguous():
            raise ValueError(
                f"out {tuple(out.shape)} is not a contiguous {(*x.shape[:-1], out_features)}"
            )
    if rows.shape[0]:
        library().linear_f32(
            rows.data_ptr(),
            rows.stride(0),
            weight_blocked.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out_features,
            rows.shape[0],
            in_features,
            out_features,
            torch.get_num_threads(),
        )
    return out


def linear_argmax(x: torch.Tensor, weight_blocked: torch.Tensor, vocab: int) -> torch.Tensor:
    """argmax over the first `vocab` columns of x [M, K] @ W^T (W given by block_weight()) per
    row, [M] int64, without materialising the logits; the index linear() + argmax_rows() give."""
    check_cpu(x, "x")
    check_cpu(weight_blocked, "weight_blocked")
    blocks, in_features, width = weight_blocked.shape
    if (
        width != LINEAR_BLOCK
        or not weight_blocked.is_contiguous()
        or x.dim() != 2
        or x.shape[1] != in_features
        or not 0 < vocab <= blocks * LINEAR_BLOCK
    ):
        raise ValueError(
            f"x {tuple(x.shape)} / vocab {vocab} do not match the blocked weight "
            f"{tuple(weight_blocked.shape)}"
        )
    rows = as_matrix(x, in_features)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        library().linear_argmax_f32(
            rows.data_ptr(),
            rows.stride(0),
            weight_blocked.data_ptr(),
            rows.shape[0],
            in_features,
            blocks * LINEAR_BLOCK,
            vocab,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out


def fused_swiglu_pays() -> bool:
    """Whether swiglu() beats linear() + silu_and_mul() on this build: it does with 512-bit
    vectors (6-row tiles); with 256-bit ones its tiles are a single row."""
    return library().swiglu_tile_rows() > 1


def block_weight_pairs(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused [gate; up] weight [2I, K] -> swiglu()'s layout [I/32, 2, K, 32]."""
    check_cpu(gate_up, "gate_up")
    rows, in_features = gate_up.shape
    if rows % (2 * LINEAR_BLOCK):
        raise ValueError(f"gate_up rows {rows} are not twice a multiple of {LINEAR_BLOCK}")
    gate, up = block_weight(gate_up[: rows // 2]), block_weight(gate_up[rows // 2 :])
    return torch.stack([gate, up], dim=1).contiguous()


def swiglu(x: torch.Tensor, weight_pairs: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [..., K] with weights from block_weight_pairs()."""
    check_cpu(x, "x")
    check_cpu(weight_pairs, "weight_pairs")
    blocks, two, in_features, width = weight_pairs.shape
    if (
        (two, width) != (2, LINEAR_BLOCK)
        or not weight_pairs.is_contiguous()
        or x.shape[-1] != in_features
    ):
        raise ValueError(
            f"x {tuple(x.shape)} does not match the paired weight {tuple(weight_pairs.shape)}"
        )
    rows = as_matrix(x, in_features)
    width_out = blocks * LINEAR_BLOCK
    out = torch.empty(*x.shape[:-1], width_out)
    if rows.shape[0]:
        library().swiglu_f32(
            rows.data_ptr(),
            rows.stride(0),
            weight_pairs.data_ptr(),
            out.data_ptr(),
            width_out,
            rows.shape[0],
            in_features,
            width_out,
            torch.get_num_threads(),
        )
    return out
