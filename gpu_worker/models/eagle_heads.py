"""EAGLE and EAGLE-3 draft heads: Llama decoder layers over the target's hidden states.

Module names are the published checkpoints' (config/eagle_head.py), so weights load by name.
A head runs a pair per position p: the target's (or its own last) hidden state of p and the
token at p + 1; its output at p gives the token at p + 2 and the hidden state it feeds itself
for the next position (EAGLE's feature extrapolation; vLLM's llama_eagle*.py compute the same).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from config.eagle_head import EagleHeadSpec
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import DecoderLayer, GatedMLP, SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.weights import load_named_weights
from gpu_worker.parallel.layers import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding

Weights = Iterable[tuple[str, str, torch.Tensor]]


def _decoder_layer(spec: EagleHeadSpec) -> DecoderLayer:
    cfg = spec.arch
    bias = cfg.attention_bias
    attn = SelfAttention(cfg, qkv_bias=bias, o_bias=bias)
    return DecoderLayer(cfg, attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size))


class EagleHead(nn.Module, ABC):
    """A draft head: combine() makes the hidden input of the target's positions, forward()
    runs pairs, greedy_tokens() reads the next token (in the target's vocabulary) off them."""

    def __init__(self, spec: EagleHeadSpec, target: DecoderForCausalLM) -> None:
        super().__init__()
        cfg = spec.arch
        self.spec = spec
        self.rotary = RotaryEmbedding(
            cfg.head_dim, spec.rotary_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )
        # The target's modules the head shares are held in a tuple: not the head's parameters
        # (neither loaded nor re-laid with it).
        self.shared: tuple[nn.Module, ...] = (target.model.embed_tokens, target.lm_head)
        if spec.own_embed:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H]: the head's own table where it has one, else the target's."""
        table = self.embed_tokens if self.spec.own_embed else self.shared[0]
        return cast(torch.Tensor, table(ids))

    @abstractmethod
    def combine(self, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> torch.Tensor:
        """The hidden input [T, H] of the target's positions, from its last hidden states
        hidden [T, H] or (EAGLE-3) its intermediate ones aux."""

    @abstractmethod
    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (hidden [T, H] of position p, embedding of the token at p + 1) at positions:
        (what greedy_tokens reads, the hidden input of position p + 1). Writes the head's KV
        of those positions (forward_context's metadata); may overwrite hidden."""

    @abstractmethod
    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The argmax token [N] int64, in the target's vocabulary, of forward()'s first
        output rows x [N, H]."""

    @abstractmethod
    def attention_layers(self) -> list[Attention]:
        """Attention modules in layer order, for binding KV caches."""

    def load_weights(self, weights: Weights) -> None:
        """The checkpoint's tensors by name (q/k/v and gate/up into the fused projections);
        refuses unknown, misshapen or missing ones (WeightLoadError)."""
        load_named_weights(self, self.rewrite_weights(weights), DecoderForCausalLM.stacked_shards)

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's tensors as the head's parameters name them (by default unchanged)."""
        yield from weights

    def fill_dummy(self, seed: int) -> None:
        """Random weights (--load-format dummy), as the loader fills a model's."""
        gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.uniform_(-0.05, 0.05, generator=gen)


class Eagle1Head(EagleHead):
    """fc([embedding, hidden]) then Llama decoder layers (the first without input_layernorm),
    no final norm; logits through the target's output projection."""

    def __init__(self, spec: EagleHeadSpec, target: DecoderForCausalLM) -> None:
        super().__init__(spec, target)
        size = spec.arch.hidden_size
        self.fc = Linear(2 * size, size, bias=spec.fc_bias)
        self.layers = nn.ModuleList(_decoder_layer(spec) for _ in range(spec.num_layers))
        del self.layers[0].input_layernorm  # EAGLE's first layer reads fc's output as it is

    def combine(self, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> torch.Tensor:
        return hidden

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        first = cast(DecoderLayer, self.layers[0])
        attn = first.self_attn(x, self.rotary, cos, sin)
        normed, residual = first.post_attention_layernorm.forward_with_residual(attn, x)
        x = first.mlp(normed)
        for layer in self.layers[1:]:
            x, residual = layer(x, residual, self.rotary, cos, sin)
        out = x + residual
        return out, out

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        lm_head = cast(ParallelLMHead, self.shared[1])
        tokens = lm_head.greedy_tokens(x)
        return tokens if tokens is not None else lm_head(x).argmax(dim=-1)

    def attention_layers(self) -> list[Attention]:
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.layers]


class Eagle3Head(EagleHead):
    """fc over three intermediate hidden states of the target; one layer (midlayer) whose
    attention reads [input_layernorm(embedding), hidden_norm(hidden)]; a final norm and its own
    output projection over a draft vocabulary, mapped to the target's by d2t."""

    def __init__(self, spec: EagleHeadSpec, target: DecoderForCausalLM) -> None:
        super().__init__(spec, target)
        cfg = spec.arch
        size = cfg.hidden_size
        self.fc = Linear(3 * size, size, bias=spec.fc_bias)
        self.midlayer = _decoder_layer(spec)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.midlayer.self_attn.qkv_proj = ColumnParallelLinear(
            2 * size, (heads + 2 * kv_heads) * cfg.head_dim, bias=cfg.attention_bias
        )
        self.midlayer.hidden_norm = RMSNorm(size, cfg.rms_norm_eps)
        self.norm = RMSNorm(size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(size, spec.draft_vocab_size)
        # vLLM's norm_before_residual: the residual stream starts from the normed hidden state.
        self.norm_before_residual = bool(cfg.hf_config.get("norm_before_residual", False))
        # Draft id -> target id offsets (target = draft + d2t[draft]); None: the same ids.
        self.d2t: torch.Tensor | None
        d2t = torch.zeros(spec.draft_vocab_size, dtype=torch.int64) if spec.has_d2t else None
        self.register_buffer("d2t", d2t)

    def combine(self, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> torch.Tensor:
        assert aux is not None and len(aux) == 3, "EAGLE-3 reads the target's aux hidden states"
        return cast(torch.Tensor, self.fc(torch.cat(aux, dim=-1)))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.midlayer
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        normed = cast(RMSNorm, layer.hidden_norm)(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        attn = layer.self_attn(x, self.rotary, cos, sin)
        normed, residual = layer.post_attention_layernorm.forward_with_residual(attn, residual)
        return self.norm.forward_with_residual(layer.mlp(normed), residual)

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.lm_head.greedy_tokens(x)
        if tokens is None:
            tokens = self.lm_head(x).argmax(dim=-1)
        return tokens if self.d2t is None else tokens + self.d2t[tokens]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        for source, name, tensor in weights:
            if name == "d2t" and self.d2t is not None:
                self.d2t.copy_(tensor)
            elif name != "t2d":  # the target-to-draft mask: drafting never reads it
                yield source, name, tensor


def build_eagle_head(spec: EagleHeadSpec, target: DecoderForCausalLM) -> EagleHead:
    """The head spec describes, sharing target's embedding (and EAGLE's output projection);
    weights uninitialized (load_weights or fill_dummy)."""
    return Eagle3Head(spec, target) if spec.method == "eagle3" else Eagle1Head(spec, target)
