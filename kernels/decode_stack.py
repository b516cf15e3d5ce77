"""The fused decode step of kernels/cpu/decode_stack.c: a Llama-family decoder's layers for a few
one-token rows in one C call.

DecodeStack holds the C structs that name every layer's weights, norms and KV cache (pointers
into tensors the caller keeps alive) and a reused work buffer; run() is one step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu_library import load

F32_BLOCKED, F32_PAIRS = 0, -1  # weight types besides GGML's quantized ones
MAX_ROWS = 16  # decode_stack.c's MAX_ROWS
MAX_GROUP = 16  # decode_stack.c's MAX_GROUP: query heads per KV head
HEAD_DIMS = (64, 128)
# decode_stack.c's per-part timing, in a build with ENGINE_CPU_KERNEL_DEFINES=DECODE_STACK_PROFILE
PROFILE_THREADS = 8
PROFILE_PARTS = (
    "input norm",
    "qkv",
    "wait after qkv",
    "attention",
    "wait after attention",
    "merge attention parts",
    "o",
    "wait after o",
    "post-attention norm",
    "gate/up",
    "wait after gate/up",
    "down's sums",
    "down",
    "wait after down",
)


class _Weight(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("window", ctypes.c_int64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p),
    ]


@dataclass(frozen=True, slots=True)
class StackWeight:
    """One projection: type (a GGML quantized type, F32_BLOCKED or F32_PAIRS), [n, k], the
    tensor holding it (packed bytes or the blocked fp32 layout) and its bias."""

    type: int
    n: int
    k: int
    data: torch.Tensor
    bias: torch.Tensor | None = None

    def struct(self) -> _Weight:
        return _Weight(
            self.type,
            self.n,
            self.k,
            self.data.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
        )


@dataclass(frozen=True, slots=True)
class StackLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: StackWeight
    o: StackWeight
    gate_up: StackWeight
    down: StackWeight
    kv_cache: torch.Tensor  # [2, blocks, kv_heads, block_size, head_dim], the CPU backend's
    window: int = 0  # the layer's sliding window (0: the whole context)


@dataclass(frozen=True, slots=True)
class StackShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecodeStack:
    """The decoder layers as the C kernel sees them; the tensors named stay referenced here."""

    def __init__(
        self, shape: StackShape, layers: list[StackLayer], final_norm: torch.Tensor
    ) -> None:
        self._lib = load()
        if self._lib is None:
            raise RuntimeError("the fused decode step needs the CPU kernels")
        self._keep = (layers, final_norm)
        self._layers = (_Layer * len(layers))(
            *[
                _Layer(
                    ly.input_norm.data_ptr(),
                    ly.post_norm.data_ptr(),
                    ly.qkv.struct(),
                    ly.o.struct(),
                    ly.gate_up.struct(),
                    ly.down.struct(),
                    ly.kv_cache[0].data_ptr(),
                    ly.kv_cache[1].data_ptr(),
                    ly.window,
                )
                for ly in layers
            ]
        )
        block_size = layers[0].kv_cache.shape[3]
        self._model = _Model(
            len(layers),
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.intermediate,
            block_size,
            shape.eps,
            shape.scale,
            self._layers,
            final_norm.data_ptr(),
        )
        self.hidden = shape.hidden
        self._threads = 0
        self._work = torch.empty(0)

    def _work_for(self, threads: int) -> torch.Tensor:
        """The work buffer for MAX_ROWS rows and `threads` threads (each has its own buffers)."""
        if threads != self._threads:
            self._work = torch.empty(
                self._lib.decode_stack_work_floats(ctypes.byref(self._model), MAX_ROWS, threads)
            )
            self._threads = threads
        return self._work

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x: [M, hidden] embeddings of M one-token rows (M <= MAX_ROWS); cos, sin: [M, head_dim];
        slots: [M] int64; block_table: [>= M, stride] int32; seq_lens: [>= M] int32. Returns the
        final norm's output [M, hidden]."""
        rows = x.shape[0]
        out = torch.empty(rows, self.hidden)
        threads = torch.get_num_threads()
        rc = self._lib.decode_stack_f32(
            ctypes.byref(self._model),
            x.data_ptr(),
            out.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            seq_lens.data_ptr(),
            self._work_for(threads).data_ptr(),
            threads,
        )
        if rc:
            raise RuntimeError(f"decode_stack_f32 failed ({rc}) for {rows} rows")
        return out


def take_profile() -> list[dict[str, float]] | None:
    """Seconds per part of the fused step for each of the first PROFILE_THREADS threads,
    summed since the last call (and cleared); None in a build without the timing."""
    lib = load()
    if lib is None:
        return None
    buf = (ctypes.c_double * (PROFILE_THREADS * 16))()
    if lib.decode_stack_profile(buf):
        return None
    return [
        {name: buf[t * 16 + i] for i, name in enumerate(PROFILE_PARTS)}
        for t in range(PROFILE_THREADS)
    ]
