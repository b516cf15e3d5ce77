"""Multimodal checkpoints served as text only: their config.json nests the language model's
fields under text_config, which the engine reads as if it were the whole config.

Gemma3ForConditionalGeneration (google/gemma-3-4b-it and larger) is a Gemma 3 language model
with a vision tower: the engine runs its language model (gpu_worker/models/gemma3.py skips the
vision tensors), so a prompt of text gets the checkpoint's own text answer. Images are not
taken (the engine has no image inputs)."""

from __future__ import annotations

from typing import Any

# Architecture -> the model_type of its text_config when config.json leaves it out.
TEXT_ONLY_ARCHITECTURES: dict[str, str] = {"Gemma3ForConditionalGeneration": "gemma3_text"}

# Fields that describe the whole checkpoint, kept from the top level where it has them: the
# token ids generation stops at, the stored dtype, the quantization and the tied output
# projection (transformers ties the ForConditionalGeneration model's by the top-level config).
_CHECKPOINT_FIELDS = (
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "tie_word_embeddings",
)


def text_only(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg itself, or for an architecture of TEXT_ONLY_ARCHITECTURES its text_config (empty:
    the text config class's defaults) with the top level's architectures and checkpoint-wide
    fields; a new dict in that case, cfg unchanged."""
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in TEXT_ONLY_ARCHITECTURES:
        return cfg
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", TEXT_ONLY_ARCHITECTURES[archs[0]])
    text["architectures"] = list(archs)
    for name in _CHECKPOINT_FIELDS:
        if cfg.get(name) is not None:
            text[name] = cfg[name]
    return text
