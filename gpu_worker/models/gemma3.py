"""Gemma 3 (text): the Gemma decoder (gemma.py) with an RMSNorm ((1 + w), per head) on q and on k
before the rotary embedding, five sliding-window layers to each full one (layer_types, or
sliding_window_pattern 6), and two rotary embeddings: the full layers' (rope_theta, with
rope_scaling: linear 8 on the 4B and larger) and the sliding layers' (rope_local_base_freq, no
scaling). No soft-capping unless config.json sets it.

Gemma3ForConditionalGeneration (google/gemma-3-4b-it and larger) is served as text: its
config's text_config is read as the model's (config/multimodal_text.py), its language model's
tensors (`language_model.model.*` as Google's checkpoints name them, `model.language_model.*` as
transformers 5 saves them) load as Gemma3ForCausalLM's, and the vision tower's and the
multimodal projector's are skipped."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from config.model_arch import ModelArchConfig
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.decoder import Weights
from gpu_worker.models.gemma import GemmaForCausalLM


class Gemma3ForCausalLM(GemmaForCausalLM):
    def __init__(self, cfg: ModelArchConfig) -> None:
        # The sliding layers' rotary embedding once built (in a dict, not an attribute, so that
        # only the decoder's module list registers it).
        self._sliding_rotary: dict[str, RotaryEmbedding] = {}
        super().__init__(cfg)

    def model_rotary(self, cfg: ModelArchConfig) -> RotaryEmbedding:
        """The full layers' rotary embedding. Gemma 3's max_position_embeddings (131072) already
        counts its linear factor (vLLM's max_model_len does not extend it either), so its table
        covers that many positions, not factor times as many (2 GiB of cos/sin for the 4B):
        linear scaling's frequencies do not read max_positions, only the table's length does."""
        rope = self.gemma.full_rope
        positions = cfg.max_position_embeddings
        if rope.scaling is not None and rope.scaling["rope_type"] == "linear":
            positions = math.ceil(positions / float(rope.scaling["factor"]))
        return RotaryEmbedding(cfg.head_dim, positions, rope.theta, rope.scaling)

    def layer_rotary(self, cfg: ModelArchConfig, layer_idx: int) -> RotaryEmbedding | None:
        """The sliding layers' rotary embedding (one object for all of them), or None (the
        full layers: model_rotary's)."""
        rope = self.gemma.sliding_rope
        if rope is None or not self.gemma.sliding_layers[layer_idx]:
            return None
        if not self._sliding_rotary:
            self._sliding_rotary["sliding"] = RotaryEmbedding(
                cfg.head_dim, cfg.max_position_embeddings, rope.theta, rope.scaling
            )
        return self._sliding_rotary["sliding"]


# Where the language model's tensors sit in a Gemma3ForConditionalGeneration checkpoint, and
# what they are called in Gemma3ForCausalLM.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),  # Google's checkpoints (transformers 4)
    ("model.language_model.", "model."),  # transformers 5's save_pretrained
    ("language_model.lm_head.", "lm_head."),
)
# The image side: the vision tower and the projector into the text embeddings.
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 image-text checkpoint, served as text only."""

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        return super().rewrite_weights(language_model_tensors(weights))


def language_model_tensors(weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoint's language-model tensors named as Gemma3ForCausalLM names them; the
    vision tower's and the projector's left out; any other name passes unchanged (the loader
    refuses it if it is not the model's)."""
    for source, name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        yield source, name, tensor
