"""What Gemma 2 and Gemma 3 share over the decoder (transformers 5.24's modeling_gemma2.py and
modeling_gemma3.py): RMSNorms scaling by (1 + weight) in fp32, four norms a layer (input,
post-attention, pre-feedforward, post-feedforward: each block's output is normed before its
residual add), the GELU-tanh gated MLP, token embeddings times sqrt(hidden_size) rounded to the
model's dtype, query_pre_attn_scalar ** -0.5 as the attention scale, attention logits
soft-capping, the final logits soft-capped, and tied embeddings (config/gemma_arch.py parses the
fields). gemma2.py and gemma3.py say what differs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from config.gemma_arch import GemmaConfig
from config.model_arch import ModelArchConfig
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import GatedMLP, SelfAttention, add_and_norm
from gpu_worker.models.decoder import DecoderForCausalLM, Weights


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x / rms(x) * (1 + w) computed in fp32 and stored in x's dtype.

    Its `weight` holds 1 + w in fp32 whatever the model's dtype (GemmaForCausalLM's
    rewrite_weights adds the 1 to the checkpoint's w, in fp32 as transformers does at every
    call), so RMSNorm's kernels, forward_with_residual's fused residual add included, compute
    it as they compute any RMSNorm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)


class GemmaDecoderLayer(nn.Module):
    """input_layernorm -> attention -> post_attention_layernorm, added to the residual, then
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm, added to the residual; the
    residual add is fused into the next norm, as in DecoderLayer."""

    def __init__(self, cfg: ModelArchConfig, self_attn: SelfAttention, mlp: nn.Module) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = add_and_norm(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rotary, cos, sin))
        x, residual = self.pre_feedforward_layernorm.forward_with_residual(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(DecoderForCausalLM):
    """The Gemma decoder; a version subclasses it with its config parse (gemma) and, for Gemma 3,
    the per-head q/k norms and the sliding layers' own rotary embedding."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        self.gemma = GemmaConfig.from_hf(cfg.hf_config, cfg.architecture)
        super().__init__(cfg)
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decoder_layer(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return GemmaDecoderLayer(
            cfg, self.attention_block(cfg, layer_idx), self.mlp_block(cfg, layer_idx)
        )

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        attn = SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=self.gemma.qk_norm,
            sliding_window=cfg.layer_sliding_window(layer_idx),
            scale=self.gemma.attention_scale,
            logits_soft_cap=self.gemma.attn_logit_softcapping,
        )
        if self.gemma.qk_norm:  # Gemma 3: (1 + w) norms on each head of q and k
            attn.q_norm = GemmaRMSNorm(attn.head_dim, cfg.rms_norm_eps)
            attn.k_norm = GemmaRMSNorm(attn.head_dim, cfg.rms_norm_eps)
        return attn

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.gemma.hidden_activation)

    def model_rotary(self, cfg: ModelArchConfig) -> RotaryEmbedding:
        rope = self.gemma.full_rope
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope.theta, rope.scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden_size) in the embeddings' dtype (bf16: 55.5 for
        # sqrt(3072) = 55.43), and so must the engine to match it.
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, soft-capped where final_logit_softcapping is set: cap * tanh(l / cap), in
        place (an increasing map: greedy_tokens' argmax stays valid)."""
        logits = super().compute_logits(hidden, out)
        cap = self.gemma.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Each norm's checkpoint w as the 1 + w in fp32 its GemmaRMSNorm holds."""
        for source, name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = 1.0 + tensor.float()
            yield source, name, tensor
