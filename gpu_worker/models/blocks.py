"""The decoder's building blocks that model families share: the attention block, the gated MLP,
the pre-norm decoder layer and the model body. Module names are the Hugging Face checkpoints'
(self_attn.qkv_proj, mlp.gate_up_proj, input_layernorm, ...), so weights load by name."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.activation import GATED_ACTIVATIONS
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.cpu_linear import SwiGLUPairsLinearMethod
from gpu_worker.layers.fp8_linear import Fp8Activation, Fp8LinearMethod
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.thread_split_mlp import ThreadSplitMLP, ThreadSplitPart
from gpu_worker.models.mlp_layout import (
    FusedSwiGLUMLP,
    MLPLayout,
    PlainMLP,
    ThreadSplitMLPLayout,
)
from gpu_worker.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
)


class SelfAttention(nn.Module):
    """Self-attention with a fused QKV projection, optional RMSNorm on each head of q and k
    (qk_norm), rotary embeddings and grouped-query attention.

    Under tensor parallelism each rank owns num_heads / TP query heads and num_kv_heads / TP KV
    heads: its qkv_proj rows are [its q heads, its k heads, its v heads], and o_proj sums the
    ranks' partial outputs.
    """

    def __init__(
        self,
        cfg: ModelArchConfig,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        sinks: bool = False,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """sliding_window, sinks, logits_soft_cap: this layer's (gpu_worker/layers/attention.py's
        Attention); scale: the scores' factor (default head_dim ** -0.5; Gemma's
        query_pre_attn_scalar ** -0.5, Granite's attention_multiplier)."""
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads = divide(heads, "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qk_norm = qk_norm
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (heads + 2 * kv_heads) * cfg.head_dim, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
            sinks=sinks,
            logits_soft_cap=logits_soft_cap,
        )

    def shard_slice(self, shard_id: str | int) -> tuple[int, int]:
        """Rows of this rank's qkv_proj holding q, k or v: (start, size)."""
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[str(shard_id)]

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, heads + kv_heads, self.head_dim)
        if self.qk_norm and not rotary.fuses_qk_norm(qk):
            q, k = self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])
            q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        else:
            if self.qk_norm:  # both norms and both rotations in one C pass, in place in qkv
                qk = rotary.qk_norm_apply_(
                    qk, heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin
                )
            else:  # q and k rotate together: one set of ops instead of two
                qk = rotary.apply_(qk, cos, sin)
            q, k = qk.split([heads, kv_heads], dim=1)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward, down(silu(x @ gate^T) * (x @ up^T)), gate and up one projection.

    Under tensor parallelism each rank owns intermediate_size / TP columns of gate and of up and
    the matching rows of down; the ranks' partial outputs are summed. On the CPU it may take a
    layout of both projections together (use_fused_swiglu, use_thread_split): its `layout`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        """activation: the gate's, "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"gated MLP activation {activation!r} is not supported: "
                f"{', '.join(GATED_ACTIVATIONS)}"
            )
        self.activation = activation
        self.intermediate = divide(intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.layout: MLPLayout = PlainMLP(GATED_ACTIVATIONS[activation])

    def use_fused_swiglu(self) -> bool:
        """CPU fp32 with 512-bit vectors: gate/up weights blocked in pairs for the fused
        SwiGLU kernel, which never writes the [tokens, 2I] intermediate. False where it does not
        apply or pay (then the children take the plain blocked layout)."""
        weight = self.gate_up_proj.weight
        if self.activation != "silu":
            return False
        if weight is None or not SwiGLUPairsLinearMethod.applies(weight):
            return False
        pairs = SwiGLUPairsLinearMethod(weight)
        self.gate_up_proj.use_method(pairs)
        self.layout = FusedSwiGLUMLP(pairs)
        return True

    def use_thread_split(self, splits: int) -> None:
        """CPU layout without the C kernels: both projections split across `splits` threads
        (ThreadSplitMLP), where the intermediate size divides evenly; the projections' methods
        then only count the bytes it holds for them (ThreadSplitPart)."""
        gate_up, down = self.gate_up_proj.weight, self.down_proj.weight
        if self.activation != "silu":  # ThreadSplitMLP computes SwiGLU
            return
        if gate_up is None or down is None or self.intermediate % splits:
            return
        split = ThreadSplitMLP(gate_up, down, splits)
        self.gate_up_proj.use_method(ThreadSplitPart(self.gate_up_proj, split.gate_up))
        self.down_proj.use_method(ThreadSplitPart(self.down_proj, split.down))
        self.layout = ThreadSplitMLPLayout(split)

    def shard_slice(self, shard_id: str | int) -> tuple[int, int]:
        """Rows of this rank's gate_up_proj holding gate (0) or up (1): (start, size)."""
        return int(shard_id) * self.intermediate, self.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.forward(self.gate_up_proj, self.down_proj, x)


def add_and_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the add fused into the norm; the first layer's x
    (residual None) is normed and becomes the residual."""
    if residual is None:
        return norm(x), x
    return norm.forward_with_residual(x, residual)


def norm_into(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, fp8: Fp8LinearMethod | None
) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """add_and_norm, or where the norm feeds one W8A8 projection (fp8), its output quantized
    for that projection in the same kernel (Fp8Activation, which the projection takes as x)."""
    if fp8 is None:
        return add_and_norm(norm, x, residual)
    return fp8.norm_and_quantize(norm, x, residual)


def _w8a8(linear: Linear) -> Fp8LinearMethod | None:
    method = linear.method
    return method if isinstance(method, Fp8LinearMethod) and method.w8a8 else None


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm, and so
    is the activation quantization of a W8A8 (FP8) qkv_proj or gate_up_proj after it."""

    def __init__(self, cfg: ModelArchConfig, self_attn: SelfAttention, mlp: nn.Module) -> None:
        """mlp: the feed-forward block, x [T, H] to [T, H] (GatedMLP unless the family says)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        # fp8_inputs(), found at the first step (the loader has given the methods by then).
        self._fp8_inputs: tuple[Fp8LinearMethod | None, Fp8LinearMethod | None] | None = None

    def fp8_inputs(self) -> tuple[Fp8LinearMethod | None, Fp8LinearMethod | None]:
        """The W8A8 methods of qkv_proj and of gate_up_proj (None where a projection has
        another, or its block reads the normed x otherwise than through that projection alone),
        whose input quantization runs in the norm before them; kept for the later steps."""
        attn, mlp = self.self_attn, self.mlp
        qkv = _w8a8(attn.qkv_proj) if type(attn) is SelfAttention else None
        gate_up = None
        if isinstance(mlp, GatedMLP) and type(mlp) is GatedMLP and type(mlp.layout) is PlainMLP:
            gate_up = _w8a8(mlp.gate_up_proj)
        self._fp8_inputs = (qkv, gate_up)
        return self._fp8_inputs

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fp8_qkv, fp8_gate_up = self._fp8_inputs or self.fp8_inputs()
        normed, residual = norm_into(self.input_layernorm, x, residual, fp8_qkv)
        x = self.self_attn(normed, rotary, cos, sin)
        normed, residual = norm_into(self.post_attention_layernorm, x, residual, fp8_gate_up)
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    """The body: token embedding, decoder layers and final norm."""

    def __init__(self, cfg: ModelArchConfig, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
