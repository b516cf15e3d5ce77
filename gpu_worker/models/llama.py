"""The Llama family (Llama, Mistral, SmolLM): the base decoder the other architectures extend."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.fused_decode import FusedDecode
from gpu_worker.models.weights import StackedShard, load_named_weights
from gpu_worker.parallel.group import tp_all_reduce
from gpu_worker.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
)
from kernels import activation, cpu_binding
from kernels import linear as cpu_linear


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV projection, rotary embeddings and GQA.

    Under tensor parallelism each rank owns num_heads / TP query heads and num_kv_heads / TP KV
    heads: its qkv_proj rows are [its q heads, its k heads, its v heads], and o_proj sums the
    ranks' partial outputs.
    """

    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads = divide(heads, "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            (heads + 2 * kv_heads) * cfg.head_dim,
            bias=self.qkv_bias or cfg.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias and not self.qkv_bias
        )
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def shard_slice(self, shard_id: str | int) -> tuple[int, int]:
        """Rows of this rank's qkv_proj holding q, k or v: (start, size)."""
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].reshape(tokens, heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].reshape(
                    tokens, kv_heads, self.head_dim
                )
            )
            q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        else:
            # q and k rotate together: one set of ops instead of two.
            qk = qkv[:, : self.q_size + self.kv_size].view(tokens, heads + kv_heads, self.head_dim)
            q, k = rotary.apply_(qk, cos, sin).split([heads, kv_heads], dim=1)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with fused gate and up projections.

    Under tensor parallelism each rank owns intermediate_size / TP columns of gate and of up and
    the matching rows of down; the ranks' partial outputs are summed.
    """

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate = divide(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.split_gate_up: torch.Tensor | None = None
        self.split_down: torch.Tensor | None = None
        self.fused_gate_up: torch.Tensor | None = None

    def use_fused_swiglu(self) -> bool:
        """CPU fp32 with 512-bit vectors: gate/up weights blocked in pairs for the fused
        SwiGLU kernel, which never writes the [tokens, 2I] intermediate. False where it does not
        apply or pay (then the children take the plain blocked layout)."""
        weight = self.gate_up_proj.weight
        if (
            weight is None
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or self.intermediate % cpu_linear.LINEAR_BLOCK
            or not cpu_binding.available()
            or not cpu_linear.fused_swiglu_pays()
        ):
            return False
        self.fused_gate_up = cpu_linear.block_weight_pairs(weight.detach())
        self.gate_up_proj.weight = None
        return True

    def use_split_layout(self, splits: int) -> None:
        """CPU layout: split the MLP across threads like tensor parallelism.

        Thread s holds gate and up columns [s*I/S, (s+1)*I/S) and the matching rows of down, so
        one bmm computes each slice's activations and another its partial output; summing the
        S partial outputs replaces the transpose copies a column split alone would need. Under
        tensor parallelism I is this rank's share, and the sum over ranks follows the sum over S.
        """
        inter = self.intermediate
        if inter % splits:
            return
        gate_up = self.gate_up_proj.weight.detach().t()  # [H, 2I]
        hidden = gate_up.shape[0]
        gate = gate_up[:, :inter].reshape(hidden, splits, -1)
        up = gate_up[:, inter:].reshape(hidden, splits, -1)
        self.split_gate_up = torch.cat([gate, up], dim=-1).transpose(0, 1).contiguous()
        self.split_down = (
            self.down_proj.weight.detach().t().reshape(splits, -1, hidden).contiguous()
        )
        self.gate_up_proj.weight = None
        self.down_proj.weight = None

    def shard_slice(self, shard_id: str | int) -> tuple[int, int]:
        """Rows of this rank's gate_up_proj holding gate (0) or up (1): (start, size)."""
        return int(shard_id) * self.intermediate, self.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None and x.dtype == torch.float32:
            return self.down_proj(cpu_linear.swiglu(x, self.fused_gate_up))
        if self.split_gate_up is None:
            return self.down_proj(_silu_and_mul(self.gate_up_proj(x)))
        if x.shape[0] <= _MLP_ROWS:
            return tp_all_reduce(self._split_forward(x))
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], _MLP_ROWS):
            out[start : start + _MLP_ROWS] = self._split_forward(x[start : start + _MLP_ROWS])
        return tp_all_reduce(out)

    def _split_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.bmm(
            x.unsqueeze(0).expand(self.split_gate_up.shape[0], -1, -1), self.split_gate_up
        )
        return torch.bmm(_silu_and_mul(y), self.split_down).sum(dim=0)


# Rows of one MLP pass on the CPU. Bigger steps go through in slices: the intermediate
# activations of 8192 rows are ~100 MB, which glibc maps fresh (and the kernel zeroes) on every
# call, while a 1024-row slice stays in reused, cache-warm memory (MLP of 4803 rows measured at
# 185 GFLOP/s whole and 208 in 1024-row slices).
_MLP_ROWS = 1024


def _silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y = [..., gate | up]: one fused pass in fp32 on the CPU and, with
    Triton, on CUDA."""
    if cpu_binding.applies(y):
        return activation.silu_and_mul_cpu(y)
    if y.device.type == "cuda":
        if activation.fits(y):
            return activation.silu_and_mul(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the next norm."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn(x, rotary, cos, sin)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, cfg: ModelArchConfig, layer_cls: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM; forward() returns hidden states, compute_logits() the logits."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    stacked_shards = (
        StackedShard("qkv_proj", "q_proj", "q"),
        StackedShard("qkv_proj", "k_proj", "k"),
        StackedShard("qkv_proj", "v_proj", "v"),
        StackedShard("gate_up_proj", "gate_proj", 0),
        StackedShard("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, self.layer_cls)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.fused_decode = FusedDecode(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if (fused := self.fused_decode.run(x, cos, sin)) is not None:
            return fused
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, self.rotary, cos, sin)
        x, _ = self.model.norm.forward_with_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for the given hidden states [N, hidden]; out, a reused
        [N, vocab] fp32 buffer, receives them where the kernels can write into it (CPU)."""
        return self.lm_head(hidden, out).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row of hidden [N, hidden] without the logits, or None where
        no kernel fuses the output projection with the argmax (then: compute_logits)."""
        return self.lm_head.greedy_tokens(hidden)

    def attention_layers(self) -> list[Attention]:
        """Attention modules in layer order, for binding KV caches."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (source file, HF name, tensor) into the fused parameters."""
        tied = self.cfg.tie_word_embeddings
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        load_named_weights(self, weights, self.stacked_shards, skip)
