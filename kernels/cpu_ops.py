"""Tensor-level entry points of the C kernels (kernels/cpu/): fp32 CPU tensors only (weights may
also be GGUF-quantized, packed by kernels.gguf_quant).

Each function checks the layout it relies on and raises ValueError otherwise, so a caller can
never hand the kernels memory they would misread. available() says whether the library loaded.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_library import load
from kernels.gguf_quant import QuantizedWeight
from kernels.prepared_inputs import PreparedInputs, check_outputs, empty_outputs


def available() -> bool:
    """True when the C kernels are built and loaded on this machine."""
    return load() is not None


def _lib():
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib


def _check(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    if not t.is_cpu or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")


def _rows(t: torch.Tensor, name: str) -> None:
    """Every dimension but the first is packed (the first may have any stride)."""
    if t.is_contiguous():  # the common case, without walking the strides in Python
        return
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name} must be contiguous after its first dimension")
        expected *= size


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of packed queries q [T, Hq, D] over the paged caches, reading blocks
    in place; returns [T, Hq, D]. Caches in the CPU layout: key_cache [num_blocks, Hkv, D,
    block_size] (each block's keys transposed), value_cache [num_blocks, Hkv, block_size, D];
    block_size a multiple of 16, D 64 or 128."""
    for t, name in ((q, "q"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        _check(t, name)
    for t, name in (
        (block_table, "block_table"),
        (query_start_loc, "query_start_loc"),
        (seq_lens, "seq_lens"),
    ):
        _check(t, name, torch.int32)
    _rows(q, "q")
    if not (
        key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and block_table.stride(1) == 1
        and query_start_loc.is_contiguous()
        and seq_lens.is_contiguous()
    ):
        raise ValueError(
            "caches, block_table rows, query_start_loc and seq_lens must be contiguous"
        )
    tokens, q_heads, head_dim = q.shape
    num_blocks, kv_heads, cache_dim, block_size = key_cache.shape
    if (
        cache_dim != head_dim
        or q_heads % kv_heads
        or value_cache.shape != (num_blocks, kv_heads, block_size, head_dim)
    ):
        raise ValueError(
            f"q {tuple(q.shape)} does not match caches {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if out is None:
        out = torch.empty(tokens, q_heads, head_dim)
    _rows(out, "out")
    num_reqs = seq_lens.shape[0]
    if num_reqs and tokens:
        rc = _lib().paged_attention_f32(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            out.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            num_reqs,
            q_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError(
                f"the CPU paged attention kernel takes head_dim 64 or 128 and a "
                f"block_size that is a multiple of 16, not {head_dim} and {block_size}"
            )
        if rc != 0:
            raise MemoryError("paged_attention_f32 could not allocate its scratch memory")
    return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's k/v [T, Hkv, D] into cache slot slot_mapping[t] (negative: skipped), in
    the CPU layout paged_attention() reads."""
    for t, name in ((k, "k"), (v, "v"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        _check(t, name)
    _check(slot_mapping, "slot_mapping", torch.int64)
    _rows(k, "k")
    _rows(v, "v")
    num_blocks, kv_heads, head_dim, block_size = key_cache.shape
    if not (
        key_cache.is_contiguous() and value_cache.is_contiguous() and slot_mapping.is_contiguous()
    ):
        raise ValueError("caches and slot_mapping must be contiguous")
    if (
        k.shape[1:] != (kv_heads, head_dim)
        or v.shape != k.shape
        or slot_mapping.shape[0] != k.shape[0]
    ):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache")
    _lib().write_kv_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slot_mapping.data_ptr(),
        k.shape[0],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_heads,
        head_dim,
        block_size,
        torch.get_num_threads(),
    )


def _check_bias(bias: torch.Tensor | None, out_features: int) -> None:
    if bias is not None:
        _check(bias, "bias")
        if bias.shape != (out_features,) or not bias.is_contiguous():
            raise ValueError(f"bias {tuple(bias.shape)} does not match {out_features} outputs")


def _matrix(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] as [M, K] with packed rows (any row stride)."""
    rows = x.reshape(-1, in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Columns per weight block of linear() (kernels/cpu/linear.c).
LINEAR_BLOCK = 32


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the layout linear() reads, [N/32, K, 32] (N a multiple of 32)."""
    _check(weight, "weight")
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
    _check(x, "x")
    _check(weight_blocked, "weight_blocked")
    blocks, in_features, width = weight_blocked.shape
    if width != LINEAR_BLOCK or not weight_blocked.is_contiguous() or x.shape[-1] != in_features:
        raise ValueError(
            f"x {tuple(x.shape)} does not match the blocked weight {tuple(weight_blocked.shape)}"
        )
    out_features = blocks * LINEAR_BLOCK
    _check_bias(bias, out_features)
    rows = _matrix(x, in_features)
    if out is None:
        out = torch.empty(*x.shape[:-1], out_features)
    else:
        _check(out, "out")
        if out.shape != (*x.shape[:-1], out_features) or not out.is_contiguous():
            raise ValueError(
                f"out {tuple(out.shape)} is not a contiguous {(*x.shape[:-1], out_features)}"
            )
    if rows.shape[0]:
        _lib().linear_f32(
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


def fused_swiglu_pays() -> bool:
    """Whether swiglu() beats linear() + silu_and_mul() on this build: it does with 512-bit
    vectors (6-row tiles); with 256-bit ones its tiles are a single row."""
    return _lib().swiglu_tile_rows() > 1


def block_weight_pairs(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused [gate; up] weight [2I, K] -> swiglu()'s layout [I/32, 2, K, 32]."""
    _check(gate_up, "gate_up")
    rows, in_features = gate_up.shape
    if rows % (2 * LINEAR_BLOCK):
        raise ValueError(f"gate_up rows {rows} are not twice a multiple of {LINEAR_BLOCK}")
    gate, up = block_weight(gate_up[: rows // 2]), block_weight(gate_up[rows // 2 :])
    return torch.stack([gate, up], dim=1).contiguous()


def swiglu(x: torch.Tensor, weight_pairs: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [..., K] with weights from block_weight_pairs()."""
    _check(x, "x")
    _check(weight_pairs, "weight_pairs")
    blocks, two, in_features, width = weight_pairs.shape
    if (
        (two, width) != (2, LINEAR_BLOCK)
        or not weight_pairs.is_contiguous()
        or x.shape[-1] != in_features
    ):
        raise ValueError(
            f"x {tuple(x.shape)} does not match the paired weight {tuple(weight_pairs.shape)}"
        )
    rows = _matrix(x, in_features)
    width_out = blocks * LINEAR_BLOCK
    out = torch.empty(*x.shape[:-1], width_out)
    if rows.shape[0]:
        _lib().swiglu_f32(
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :w]) * x[..., w:] for x [..., 2w]; returns a new [..., w] tensor."""
    _check(x, "x")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    out = torch.empty(*x.shape[:-1], width)
    _lib().silu_and_mul_f32(
        rows.data_ptr(),
        rows.stride(0),
        out.data_ptr(),
        width,
        rows.shape[0],
        width,
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place; returns (rms_norm(residual) * weight, residual)."""
    for t, name in ((x, "x"), (residual, "residual"), (weight, "weight")):
        _check(t, name)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"shapes differ: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    out = torch.empty_like(x)
    width = x.shape[-1]
    _lib().add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        x.numel() // width if width else 0,
        width,
        eps,
        torch.get_num_threads(),
    )
    return out, residual


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding in place on x [T, H, D] (heads packed; tokens any stride)
    with per-token tables cos/sin [T, D] (or [T, 1, D]) whose sin has its first half negated."""
    for t, name in ((x, "x"), (cos, "cos"), (sin, "sin")):
        _check(t, name)
    _rows(x, "x")
    tokens, heads, head_dim = x.shape
    if (
        not (cos.is_contiguous() and sin.is_contiguous())
        or cos.numel() != tokens * head_dim
        or sin.shape != cos.shape
    ):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    _lib().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return x


def applies(x: torch.Tensor) -> bool:
    """Whether the fused kernels can take this activation: fp32, on the CPU, library loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


@functools.cache
def _block_bytes(qtype: int, in_features: int) -> int:
    return _lib().quant_block_bytes(qtype, in_features)


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
    _check(x, "x")
    _check_quantized(weight)
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's {k} inputs")
    _check_bias(bias, n)
    # Called per layer per step: the common 2-D packed case skips the reshapes.
    rows = x if x.dim() == 2 and x.stride(1) == 1 else _matrix(x, k)
    m = rows.shape[0]
    if out is None:
        out = torch.empty(m, n)
    else:
        _check(out, "out")
        if out.shape != (m, n) or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out {tuple(out.shape)} is not [{m}, {n}] with packed columns")
    if m:
        _lib().quant_linear_f32(
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
    return int(_lib().quant_few_rows())


def quant_linear_argmax(x: torch.Tensor, weight: QuantizedWeight, vocab: int) -> torch.Tensor:
    """argmax over the first `vocab` columns of x [M, K] @ W^T per row, [M] int64, for M up to
    quant_few_rows(), without writing the logits; the index quant_linear() and argmax_rows()
    give."""
    _check(x, "x")
    _check_quantized(weight)
    k = weight.in_features
    if x.dim() != 2 or x.shape[1] != k or not 0 < vocab <= weight.out_features:
        raise ValueError(
            f"x {tuple(x.shape)} / vocab {vocab} do not match the quantized weight "
            f"[{weight.out_features}, {k}]"
        )
    if not 0 < x.shape[0] <= quant_few_rows():
        raise ValueError(f"{x.shape[0]} rows: the fused argmax takes 1 to {quant_few_rows()}")
    rows = _matrix(x, k)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    _lib().quant_linear_argmax_f32(
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
    _lib().quant_dequantize_f32(
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
    _check(ids, "ids", torch.int64)
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty(*ids.shape, weight.in_features)
    rc = _lib().quant_rows_f32(
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


def prepare_inputs(
    slots: torch.Tensor,
    qsl: torch.Tensor,
    sample_rows: torch.Tensor,
    num_computed: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_blocks: int,
    out: PreparedInputs | None = None,
) -> PreparedInputs:
    """kernels.prepare_inputs' contract in one C call (kernels/cpu/prepare_inputs.c); into
    out's tensors when given (checked: the C code writes them through raw pointers)."""
    i64, i32 = torch.int64, torch.int32
    # Once per step: the whole check in one expression, the messages only when it fails.
    if not (
        slots.dtype is i64
        and qsl.dtype is i32
        and sample_rows.dtype is i64
        and num_computed.dtype is i64
        and token_ids.dtype is i64
        and block_table.dtype is i32
        and slots.is_cpu
        and qsl.is_cpu
        and sample_rows.is_cpu
        and num_computed.is_cpu
        and token_ids.is_cpu
        and block_table.is_cpu
        and slots.is_contiguous()
        and qsl.is_contiguous()
        and sample_rows.is_contiguous()
        and num_computed.is_contiguous()
        and token_ids.is_contiguous()
        and block_table.is_contiguous()
    ):
        for t, name, dtype in (
            (slots, "slots", i64),
            (qsl, "qsl", i32),
            (sample_rows, "sample_rows", i64),
            (num_computed, "num_computed", i64),
            (token_ids, "token_ids", i64),
            (block_table, "block_table", i32),
        ):
            _check(t, name, dtype)
        raise ValueError("prepare_inputs needs contiguous tensors")
    num_reqs = slots.shape[0]
    if qsl.shape != (num_reqs + 1,) or not 0 <= max_blocks <= block_table.shape[1]:
        raise ValueError(
            f"qsl {tuple(qsl.shape)} / max_blocks {max_blocks} do not match "
            f"{num_reqs} requests and a block table {tuple(block_table.shape)}"
        )
    num_samples = sample_rows.shape[0]
    if out is None:
        out = empty_outputs(slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    else:
        check_outputs(out, slots.device, num_reqs, num_tokens, max_blocks, num_samples)
    _lib().prepare_inputs_i64(
        slots.data_ptr(),
        qsl.data_ptr(),
        num_reqs,
        num_computed.data_ptr(),
        token_ids.data_ptr(),
        token_ids.stride(0),
        block_table.data_ptr(),
        block_table.stride(0),
        block_size,
        max_blocks,
        sample_rows.data_ptr(),
        num_samples,
        *(t.data_ptr() for t in out),
    )
    return out


def post_update(
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    sample_slots: torch.Tensor,
    sampled: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    num_output: torch.Tensor,
) -> None:
    """kernels.post_update's contract in one C call (kernels/cpu/post_update.c)."""
    i64 = torch.int64
    # Once per step: the whole check in one expression, the messages only when it fails.
    if not (
        slots.dtype is i64
        and seq_lens.dtype is torch.int32
        and sample_slots.dtype is i64
        and sampled.dtype is i64
        and num_computed.dtype is i64
        and num_tokens.dtype is i64
        and token_ids.dtype is i64
        and num_output.dtype is i64
        and slots.is_cpu
        and seq_lens.is_cpu
        and sample_slots.is_cpu
        and sampled.is_cpu
        and num_computed.is_cpu
        and num_tokens.is_cpu
        and token_ids.is_cpu
        and num_output.is_cpu
        and slots.is_contiguous()
        and seq_lens.is_contiguous()
        and sample_slots.is_contiguous()
        and sampled.is_contiguous()
        and num_computed.is_contiguous()
        and num_tokens.is_contiguous()
        and token_ids.is_contiguous()
        and num_output.is_contiguous()
    ):
        for t, name, dtype in (
            (slots, "slots", i64),
            (seq_lens, "seq_lens", torch.int32),
            (sample_slots, "sample_slots", i64),
            (sampled, "sampled", i64),
            (num_computed, "num_computed", i64),
            (num_tokens, "num_tokens", i64),
            (token_ids, "token_ids", i64),
            (num_output, "num_output", i64),
        ):
            _check(t, name, dtype)
            if not t.is_contiguous():
                raise ValueError(f"post_update needs a contiguous {name}")
    if seq_lens.shape != slots.shape or sampled.shape != sample_slots.shape:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} / sampled {tuple(sampled.shape)} "
            f"do not match slots {tuple(slots.shape)} / sample_slots "
            f"{tuple(sample_slots.shape)}"
        )
    _lib().post_update_i64(
        slots.data_ptr(),
        seq_lens.data_ptr(),
        slots.shape[0],
        sample_slots.data_ptr(),
        sampled.data_ptr(),
        sample_slots.shape[0],
        num_computed.data_ptr(),
        num_tokens.data_ptr(),
        token_ids.data_ptr(),
        token_ids.stride(0),
        num_output.data_ptr(),
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] fp32 (rows any stride, columns packed) -> [N] int64, the first index of each
    row's maximum: torch.argmax(x, -1) for rows without NaN (a NaN row gives some index)."""
    _check(x, "x")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x {tuple(x.shape)} must be 2-D with packed columns")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and x.shape[1]:
        _lib().argmax_rows_f32(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
    elif x.shape[0]:
        raise ValueError("argmax of an empty row")
    return out


def linear_argmax(x: torch.Tensor, weight_blocked: torch.Tensor, vocab: int) -> torch.Tensor:
    """argmax over the first `vocab` columns of x [M, K] @ W^T (W given by block_weight()) per
    row, [M] int64, without materialising the logits; the index linear() + argmax_rows() give."""
    _check(x, "x")
    _check(weight_blocked, "weight_blocked")
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
    rows = _matrix(x, in_features)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        _lib().linear_argmax_f32(
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
