"""OLMo 2 (AllenAI): no pre-norms; each block's output is normed before its residual add
(post_attention_layernorm after attention, post_feedforward_layernorm after the MLP), and q and
k are RMS-normed over their whole projection width (num_heads * head_dim, not per head) before
the rotary embedding. Llama's attention and SwiGLU MLP otherwise (attention_bias on q, k, v, o).

Under tensor parallelism a rank holds its heads' slice of q and k: the mean of squares spans
the ranks, so the ranks all-reduce each token's sums of squares (q's and k's, one call) and
scale their slices with their slices of the norm weights."""

from __future__ import annotations

import torch
from torch import nn

from config.dense_arch import check_olmo2
from config.model_arch import ModelArchConfig
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import GatedMLP, SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.parallel.group import tp_all_reduce, tp_world_size


def _rank_norm(width: int, eps: float) -> RMSNorm:
    """An RMSNorm over this rank's `width` columns whose weight the checkpoint holds for all
    ranks' columns (the loader gives each rank its slice: tp_dim 0)."""
    norm = RMSNorm(width, eps)
    norm.weight.tp_dim = 0  # type: ignore[attr-defined]  # this rank's heads' columns
    return norm


class Olmo2Attention(SelfAttention):
    """SelfAttention with q_norm and k_norm over the whole q and k projections."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        self.q_norm = _rank_norm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = _rank_norm(self.kv_size, cfg.rms_norm_eps)
        # The widths the means of squares are over: every rank's columns together.
        self.q_width = cfg.num_attention_heads * cfg.head_dim
        self.k_width = cfg.num_key_value_heads * cfg.head_dim

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, q_size] and k [T, kv_size] RMS-normed over the full widths (in fp32)."""
        if tp_world_size() == 1:
            return self.q_norm(q), self.k_norm(k)
        qf, kf = q.float(), k.float()
        sums = torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=-1)
        tp_all_reduce(sums)
        q_scale = torch.rsqrt(sums[:, :1] / self.q_width + self.q_norm.eps)
        k_scale = torch.rsqrt(sums[:, 1:] / self.k_width + self.k_norm.eps)
        q_out = qf * q_scale * self.q_norm.weight.float()
        k_out = kf * k_scale * self.k_norm.weight.float()
        return q_out.to(q.dtype), k_out.to(k.dtype)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_qk(q, k)
        # q and k side by side in one tensor rotate together (one set of ops, in place).
        qk = torch.cat([q, k], dim=-1).view(tokens, heads + kv_heads, self.head_dim)
        q, k = rotary.apply_(qk, cos, sin).split([heads, kv_heads], dim=1)
        out = self.attn(q, k, v.view(tokens, kv_heads, self.head_dim))
        return self.o_proj(out.reshape(-1, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    """h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h)).
    It returns (the MLP's normed output, h): the next layer, or the model's final norm, adds
    them (DecoderForCausalLM's convention)."""

    def __init__(self, cfg: ModelArchConfig, self_attn: Olmo2Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x if residual is None else x + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rotary, cos, sin))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelArchConfig) -> None:
        check_olmo2(cfg.hf_config)
        super().__init__(cfg)

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return Olmo2Attention(cfg)

    def decoder_layer(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return Olmo2DecoderLayer(
            cfg, Olmo2Attention(cfg), GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )
