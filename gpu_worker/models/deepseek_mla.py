"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention block, in the absorbed form.

Each token's keys and values come from one compressed vector: c_kv = norm(x W_DKV^T) of
kv_lora_rank elements, and a rotary key k_pe of qk_rope_head_dim shared by every head. With
W_UK_h [qk_nope, rank] and W_UV_h [v, rank] head h's rows of kv_b_proj, head h's key is
[c_kv W_UK_h^T | k_pe] and its value c_kv W_UV_h^T. Only [c_kv | k_pe] is cached (the MLA
backends: gpu_worker/attention/mla_*). Attention reads it as it is: q_nope_h W_UK_h puts each
query head in latent space, so q.k is [q_nope_h W_UK_h | q_pe_h] . [c_kv | k_pe], one KV head
for all query heads; the weighted sum of c_kv is then taken through W_UV_h^T. This equals
transformers' decompressed attention.

Under tensor parallelism each rank holds num_heads / TP heads (q_b_proj / q_proj and kv_b_proj
split by head, o_proj by its input); the down-projections and the latent cache are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from config.mla_arch import MLAConfig
from config.model_arch import ModelArchConfig
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.parallel.layers import ColumnParallelLinear, RowParallelLinear, divide

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not
# rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class KVUpProjection(nn.Module):
    """kv_b_proj's weight, [heads * (qk_nope + v), kv_lora_rank]: each head's W_UK rows then its
    W_UV rows. A plain parameter, not a Linear: attention reads it per head (absorbed into the
    queries and the output), never as a product with x, so no layout may replace it."""

    def __init__(self, kv_lora_rank: int, num_heads: int, head_rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_heads * head_rows, kv_lora_rank), requires_grad=False
        )
        self.weight.tp_dim = 0  # type: ignore[attr-defined]  # this rank's heads
        self.num_heads, self.head_rows = num_heads, head_rows

    def per_head(self) -> torch.Tensor:
        """[heads, qk_nope + v, kv_lora_rank] (a view)."""
        return self.weight.view(self.num_heads, self.head_rows, -1)


class DeepseekMLA(nn.Module):
    """x [T, hidden] -> attention output [T, hidden], caching one latent vector per token."""

    def __init__(self, cfg: ModelArchConfig, mla: MLAConfig) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.mla = mla
        self.num_heads = divide(heads, "num_attention_heads")
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * qk_dim)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(
            cfg.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(
            mla.kv_lora_rank, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, cfg.hidden_size, bias=bias)
        # One KV head of the latent vector's size: what the MLA backend caches.
        self.attn = Attention(
            self.num_heads,
            1,
            mla.kv_lora_rank + mla.qk_rope_head_dim,
            mla.softmax_scale(cfg.rope_scaling),
        )

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        mla, tokens, heads = self.mla, x.shape[0], self.num_heads
        rank, nope = mla.kv_lora_rank, mla.qk_nope_head_dim
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, heads, nope + mla.qk_rope_head_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [T, kv_lora_rank + qk_rope_head_dim]
        c_kv = self.kv_a_layernorm(latent[:, :rank].contiguous())
        q_pe = self._rotate(q[..., nope:], rotary, cos, sin)
        k_pe = self._rotate(latent[:, None, rank:], rotary, cos, sin)
        w_kv = self.kv_b_proj.per_head()  # [H, nope + v, rank]
        # [H, T, nope] @ [H, nope, rank]: each head's query in latent space.
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_kv[:, :nope])
        q_full = torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1)  # [T, H, rank + rope]
        kv = torch.cat([c_kv, k_pe[:, 0]], dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
        out = self.attn(q_full, kv, kv[..., :rank])  # [T, H, rank]
        # [H, T, rank] @ [H, rank, v]: each head's value projection.
        out = torch.bmm(out.transpose(0, 1), w_kv[:, nope:].transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(tokens, heads * mla.v_head_dim))

    def _rotate(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [T, heads, rope] rotated at each token's position. Interleaved pairs (x0, x1),
        (x2, x3), ... come out as [rotated evens | rotated odds], transformers' layout; q and
        k share it, so their products are those of the pairs in place."""
        if not self.mla.rope_interleave:
            return rotary.apply(x, cos, sin)
        half = x.shape[-1] // 2
        # The tables are rotate-half's: cos of each frequency twice, sin negated in the first half.
        c, s = cos[..., :half], sin[..., half:]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)
