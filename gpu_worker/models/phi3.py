"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): the shared decoder without biases; checkpoints store
q, k and v as one qkv_proj and gate and up as one gate_up_proj, split here so that tensor
parallelism shards them like every family's (the stacked_shards load path); the first
partial_rotary_factor of each head rotates (Phi-4-mini: 0.75); LongRoPE scaling; the sliding
window, where config.json sets one, on every layer (config/phi3_arch.py checks the config)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from config.model_arch import ModelArchConfig
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM, Weights


class Phi3ForCausalLM(DecoderForCausalLM):
    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg, qkv_bias=False, o_bias=False, sliding_window=cfg.layer_sliding_window(layer_idx)
        )

    def model_rotary(self, cfg: ModelArchConfig) -> RotaryEmbedding:
        return RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            rotary_dim=cfg.rotary_dim,
        )

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The fused qkv_proj split into q_proj, k_proj, v_proj (rows: all q heads, then k, then
        v, as Phi3Attention slices them) and gate_up_proj into gate_proj, up_proj (halves, gate
        first, as Phi3MLP chunks them)."""
        cfg = self.cfg
        q_rows = cfg.num_attention_heads * cfg.head_dim
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        for source, name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                parts = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
                for part, proj in zip(parts, ("q_proj", "k_proj", "v_proj"), strict=True):
                    yield source, name.replace("qkv_proj", proj), part
            elif name.endswith("mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2, dim=0)
                yield source, name.replace("gate_up_proj", "gate_proj"), gate
                yield source, name.replace("gate_up_proj", "up_proj"), up
            else:
                yield source, name, tensor
