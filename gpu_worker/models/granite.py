"""IBM Granite (3.x dense): Llama's layers with four scalars from config.json
(config/dense_arch.py GraniteConfig): the token embeddings times embedding_multiplier, each
attention and MLP output times residual_multiplier before its residual add, attention scores
scaled by attention_multiplier (not head_dim ** -0.5), and the logits divided by
logits_scaling. attention_bias puts biases on q, k, v and o."""

from __future__ import annotations

import torch
from torch import nn

from config.dense_arch import GraniteConfig
from config.model_arch import ModelArchConfig
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import DecoderLayer, GatedMLP, SelfAttention, add_and_norm
from gpu_worker.models.decoder import DecoderForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """The pre-norm layer with each block's output scaled by residual_multiplier before it joins
    the residual stream; the residual add is fused into the next norm, as in DecoderLayer (whose
    modules and weight names it keeps; the fused CPU decode step takes DecoderLayer itself only)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        self_attn: SelfAttention,
        mlp: nn.Module,
        residual_multiplier: float,
    ) -> None:
        super().__init__(cfg, self_attn, mlp)
        self.residual_multiplier = residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = add_and_norm(self.input_layernorm, x, residual)
        x = self.self_attn(x, rotary, cos, sin).mul_(self.residual_multiplier)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x).mul_(self.residual_multiplier), residual


class GraniteForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelArchConfig) -> None:
        self.granite = GraniteConfig.from_hf(cfg.hf_config)
        super().__init__(cfg)

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            scale=self.granite.attention_multiplier,
        )

    def decoder_layer(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return GraniteDecoderLayer(
            cfg,
            self.attention_block(cfg, layer_idx),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size),
            self.granite.residual_multiplier,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.granite.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # logits_scaling > 0 (GraniteConfig), so greedy_tokens' argmax of the unscaled
        # projection stays valid.
        return self.lm_head(hidden, out).float().div_(self.granite.logits_scaling)
