"""The decoder-only causal LM that model families share; a family says what differs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.blocks import DecoderLayer, DecoderModel, GatedMLP, SelfAttention
from gpu_worker.models.fused_decode import FusedDecode
from gpu_worker.models.weights import ExpertShard, StackedShard, load_named_weights
from gpu_worker.parallel.layers import ParallelLMHead

Weights = Iterable[tuple[str, str, torch.Tensor]]


class DecoderForCausalLM(nn.Module, ABC):
    """Embedding, pre-norm decoder layers (attention block, gated MLP), final norm and output
    projection; forward() returns hidden states, compute_logits() the logits. A family
    subclasses it with its attention block (biases, q/k norms) and, where it differs from the
    gated MLP, its feed-forward block (mlp_block)."""

    # Checkpoint tensors loaded as slices of the fused projections.
    stacked_shards: tuple[StackedShard, ...] = (
        StackedShard("qkv_proj", "q_proj", "q"),
        StackedShard("qkv_proj", "k_proj", "k"),
        StackedShard("qkv_proj", "v_proj", "v"),
        StackedShard("gate_up_proj", "gate_proj", 0),
        StackedShard("gate_up_proj", "up_proj", 1),
    )
    # How the checkpoint names a mixture of experts' per-expert tensors (none: no experts).
    expert_shards: tuple[ExpertShard, ...] = ()

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(
            cfg, (self.decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        )
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = self.model_rotary(cfg)
        # Each layer's rotary embedding: the model's, or the family's own for that layer
        # (layer_rotary); an nn.ModuleList of the distinct ones keeps their tables on the device.
        own = [self.layer_rotary(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.layer_rotaries = [r if r is not None else self.rotary for r in own]
        self.extra_rotaries = nn.ModuleList({id(r): r for r in own if r is not None}.values())
        self.fused_decode = FusedDecode(self)
        # EAGLE-3 (gpu_worker/spec_decode/eagle.py): the layers whose input, the residual
        # stream, forward() keeps, each with its buffer's index (keep_aux_hidden_states); None:
        # nothing kept (and only then may the CPU's fused decode step run).
        self.aux_hidden_state_layers: dict[int, int] | None = None
        # One persistent buffer [rows, hidden] per kept layer, in layer order; the first T rows
        # are the last forward's (a CUDA graph's replay rewrites the same memory).
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def model_rotary(self, cfg: ModelArchConfig) -> RotaryEmbedding:
        """The rotary embedding of every layer that layer_rotary leaves to the model: head_dim
        wide, the config's rope_theta and rope_scaling."""
        return RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def layer_rotary(self, cfg: ModelArchConfig, layer_idx: int) -> RotaryEmbedding | None:
        """Layer layer_idx's own rotary embedding (Gemma 3's sliding layers: another base and no
        scaling), or None for the model's (model_rotary). Return one object for all the layers
        that share it: its tables are looked up once a step."""
        return None

    def decoder_layer(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        """Layer layer_idx: the pre-norm DecoderLayer over attention_block and mlp_block, or a
        family's own layer (sandwich norms, post-norms, residual multipliers) with the same
        forward(x, residual, rotary, cos, sin) -> (x, residual) and a `self_attn` whose `attn`
        is the layer's Attention. The CPU's fused decode step takes DecoderLayer only."""
        return DecoderLayer(
            cfg, self.attention_block(cfg, layer_idx), self.mlp_block(cfg, layer_idx)
        )

    @abstractmethod
    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        """Layer layer_idx's attention block as this family configures it."""

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        """Layer layer_idx's feed-forward block, x [T, hidden] to [T, hidden]: the gated MLP
        unless the family has another (a mixture of experts, gpu_worker/layers/fused_moe.py)."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first hidden states [T, hidden]: the token embeddings, scaled where a family
        scales them (Gemma by sqrt(hidden_size), Granite by embedding_multiplier)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        keep = self.aux_hidden_state_layers
        if keep is None and (fused := self.fused_decode.run(x, cos, sin)) is not None:
            return fused
        tables = {id(self.rotary): (cos, sin)}
        for r in self.extra_rotaries:
            tables[id(r)] = cast(RotaryEmbedding, r).cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, (layer, rotary) in enumerate(
            zip(self.model.layers, self.layer_rotaries, strict=True)
        ):
            if keep is not None and i in keep:
                self._keep_stream(keep[i], x, residual)
            x, residual = layer(x, residual, rotary, *tables[id(rotary)])
        assert residual is not None  # a model has at least one layer
        x, _ = self.model.norm.forward_with_residual(x, residual)
        return x

    def keep_aux_hidden_states(self, layers: Iterable[int], max_tokens: int) -> None:
        """From now on forward() keeps the input of each of these layers (x + residual: the
        residual stream) in aux_hidden_states, buffers of max_tokens rows (a step's most)."""
        self.aux_hidden_state_layers = {layer: n for n, layer in enumerate(sorted(set(layers)))}
        weight = self.model.norm.weight
        self.aux_hidden_states = [
            torch.empty(max_tokens, self.cfg.hidden_size, dtype=weight.dtype, device=weight.device)
            for _ in self.aux_hidden_state_layers
        ]

    def _keep_stream(self, index: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        assert self.aux_hidden_states is not None
        buffer = self.aux_hidden_states[index]
        if buffer.shape[0] < x.shape[0]:  # past max_tokens (graphs captured before keep the old)
            buffer = self.aux_hidden_states[index] = buffer.new_empty(x.shape[0], buffer.shape[1])
        rows = buffer[: x.shape[0]]
        # Copied, never aliased: the layers update x and residual in place.
        if residual is None:
            rows.copy_(x)
        else:
            torch.add(x, residual, out=rows)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for the given hidden states [N, hidden]; out, a reused
        [N, vocab] fp32 buffer, receives them where the kernels can write into it (CPU). A
        family that transforms them (Gemma 2's final soft-capping, Granite's logits_scaling)
        overrides this, in place where it can."""
        return self.lm_head(hidden, out).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row of hidden [N, hidden] without the logits, or None where
        no kernel fuses the output projection with the argmax (then: compute_logits). Valid
        for compute_logits' increasing transforms (soft-capping, a positive scale); a family
        with any other overrides this to return None."""
        return self.lm_head.greedy_tokens(hidden)

    def attention_layers(self) -> list[Attention]:
        """Attention modules in layer order, for binding KV caches."""
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Weights) -> None:
        """Copy checkpoint tensors (source file, HF name, tensor) into the fused parameters and
        the experts (expert_shards), after the family's rewrite_weights; refuses unknown,
        misshapen or missing tensors (WeightLoadError)."""
        tied = self.cfg.tie_word_embeddings
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if tied else ())
        stream = self.rewrite_weights(weights)
        load_named_weights(self, stream, self.stacked_shards, skip, experts=self.expert_shards)

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's tensors as this model names them: a family whose checkpoints name or
        stack tensors otherwise (renamed blocks, whole-layer expert tensors) rewrites them
        here; by default unchanged."""
        yield from weights
