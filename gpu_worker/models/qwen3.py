"""Qwen3: the shared decoder with RMSNorm on each head of q and k before rotary embedding; with
use_sliding_window, the layers from max_window_layers on attend within the window."""

from __future__ import annotations

from config.model_arch import ModelArchConfig
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=True,
            sliding_window=cfg.layer_sliding_window(layer_idx),
        )
