"""The model shapes engine bench device runs (config.json alone: with load_format 'dummy' the
engine needs no weights or tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Llama 3.1 8B (its rope scaling reaches the 32k contexts a later run asks for), Llama 3.2 1B
# (the 8B's draft model in the spec stage), a 2-layer, hidden-256 Llama with the C kernels' head
# size, small enough for CI on a CPU, Qwen3-30B-A3B (48 layers, 128 experts of 768, top-8; 61 GB
# in bf16) and a 2-layer MoE of the small shape.
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    # Llama 3.2 1B: a draft model for the 8B shape (same vocabulary, tied embeddings).
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
    ),
    "qwen3-30b-a3b": dict(
        **_QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
    "small-moe": dict(
        **_QWEN3_MOE,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
    ),
}


def model_config(shape: str) -> dict[str, Any]:
    """The Hugging Face config.json of a shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        **SHAPES[shape],
    }


def write_model_dir(directory: Path, shape: str) -> Path:
    """A config.json alone: with load_format 'dummy' the engine needs no weights or tokenizer."""
    (directory / "config.json").write_text(json.dumps(model_config(shape), indent=2))
    return directory
