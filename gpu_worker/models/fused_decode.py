"""A Llama-family model's decode steps through one C call (kernels/decode_stack.py) on the CPU.

A step whose every request adds one token, at most MAX_ROWS of them, runs the whole layer stack
in the fused kernel: at batch 1 the per-op Python path cost about three times the weight reads
it drove. Applies where the kernel computes what the layers would: fp32 activations on the CPU
with the C kernels, one rank, the CPU attention backend, no q/k norms, no attention sinks,
head_dim 64 or 128, at most 16 query heads per KV head, and each projection held in one kernel
layout (one quantized run, the blocked fp32 layout or the fused SwiGLU pairs); a layer's sliding
window goes to the kernel. Elsewhere, and for prefill or mixed steps, the layers run one op at a
time. ENGINE_FUSED_DECODE=0 turns it off (for comparisons).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from gpu_worker.attention.cpu_backend import CpuAttnMetadata
from gpu_worker.forward_context import get_attn_metadata
from gpu_worker.layers.linear import Linear
from gpu_worker.models.blocks import DecoderLayer, GatedMLP, SelfAttention
from gpu_worker.parallel.group import tp_world_size
from kernels import cpu_binding
from kernels.decode_stack import (
    HEAD_DIMS,
    MAX_GROUP,
    MAX_ROWS,
    DecodeStack,
    StackLayer,
    StackShape,
    StackWeight,
)


def _weight(linear: Linear) -> StackWeight | None:
    """The projection in a layout the kernel reads, or None."""
    held = linear.method.cpu_kernel_weight()
    if held is None:
        return None
    layout, data = held
    return StackWeight(layout, linear.out_features, linear.in_features, data, linear.bias)


def _layer(layer: nn.Module) -> StackLayer | None:
    if type(layer) is not DecoderLayer:  # a family's own layer: other norms or multipliers
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (
        type(mlp) is not GatedMLP  # the kernel computes the SiLU-gated MLP only
        or type(attn) is not SelfAttention
        or mlp.activation != "silu"
        or attn.qk_norm
        or attn.attn.sinks is not None  # the kernel's softmax has no sinks
        or attn.attn.logits_soft_cap is not None
        or attn.attn.head_dim not in HEAD_DIMS
        or attn.attn.kv_cache.dim() != 5
        or attn.attn.kv_cache.dtype != torch.float32  # an fp8 cache: the backends convert it
        or attn.attn.num_heads % attn.attn.num_kv_heads
        or attn.attn.num_heads // attn.attn.num_kv_heads > MAX_GROUP
    ):
        return None
    qkv, o = _weight(attn.qkv_proj), _weight(attn.o_proj)
    gate_up, down = _weight(mlp.gate_up_proj), _weight(mlp.down_proj)
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if gate_up.bias is not None or down.bias is not None:
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return None
    window = attn.attn.sliding_window or 0
    return StackLayer(*norms, qkv, o, gate_up, down, attn.attn.kv_cache, window)


class FusedDecode:
    """Builds the kernel's view of a model once its KV caches are bound, and runs eligible steps."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._enabled: bool | None = None  # decided at the first step, once the ranks are known
        self._stack: DecodeStack | None = None
        self._cache_ptr = -1

    @property
    def enabled(self) -> bool:
        if self._enabled is None:
            self._enabled = (
                os.environ.get("ENGINE_FUSED_DECODE", "1") != "0"
                and tp_world_size() == 1
                and cpu_binding.available()
            )
        return self._enabled

    def _build(self) -> DecodeStack | None:
        inner, cfg = self.model.model, self.model.cfg
        layers = [_layer(layer) for layer in inner.layers]
        rotary = self.model.rotary
        if (
            not layers
            # One table of the model's for every layer, rotating whole heads.
            or any(r is not rotary for r in self.model.layer_rotaries)
            or rotary.rotary_dim != rotary.head_dim
            or any(ly is None for ly in layers)
            or cfg.intermediate_size % 32
            or inner.norm.weight.dtype != torch.float32
        ):
            return None
        attn = inner.layers[0].self_attn.attn
        block_size = attn.kv_cache.shape[3]
        if block_size % 16:
            return None
        shape = StackShape(
            cfg.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            attn.scale,
        )
        return DecodeStack(shape, layers, inner.norm.weight)

    def stack(self) -> DecodeStack | None:
        """The kernel's view, rebuilt when the KV caches were re-allocated."""
        ptr = self.model.model.layers[0].self_attn.attn.kv_cache.data_ptr()
        if ptr != self._cache_ptr:
            self._cache_ptr, self._stack = ptr, self._build()
        return self._stack

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states of a decode step, or None where this step is not one the
        kernel takes (then the caller runs the layers)."""
        rows = x.shape[0]
        if x.is_cuda or not 1 <= rows <= MAX_ROWS or x.dtype != torch.float32 or not self.enabled:
            return None
        meta = get_attn_metadata().metadata
        if (
            not isinstance(meta, CpuAttnMetadata)
            or meta.query_start_loc.numel() != rows + 1
            or meta.block_table.dtype != torch.int32
            or meta.seq_lens.dtype != torch.int32
            or meta.slot_mapping.dtype != torch.int64
        ):
            return None
        stack = self.stack()
        if stack is None:
            return None
        return stack.run(
            x.contiguous(),
            cos.reshape(rows, -1),
            sin.reshape(rows, -1),
            meta.slot_mapping,
            meta.block_table,
            meta.seq_lens,
        )
