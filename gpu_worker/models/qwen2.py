"""Qwen2: the shared decoder with biases on the q, k and v projections (none on o); with
use_sliding_window, the layers from max_window_layers on attend within the window."""

from __future__ import annotations

from config.model_arch import ModelArchConfig
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg, qkv_bias=True, o_bias=False, sliding_window=cfg.layer_sliding_window(layer_idx)
        )
