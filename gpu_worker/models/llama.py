"""The Llama family (Llama, Mistral, SmolLM): the shared decoder, biases on q, k, v and o where
the config's attention_bias says, and Mistral's sliding window on the layers it slides."""

from __future__ import annotations

from config.model_arch import ModelArchConfig
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            sliding_window=cfg.layer_sliding_window(layer_idx),
        )
