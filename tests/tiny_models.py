"""Small random-weight Hugging Face checkpoints for tests, written with transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)


def make_tiny_model(path: Path, arch: str = "llama", **overrides) -> Path:
    """Save a randomly initialised model of the given family to path (safetensors + config.json)."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    kwargs = {**TINY, "eos_token_id": 2, "bos_token_id": 1, "rope_theta": 10000.0, **overrides}
    if arch in ("qwen3", "qwen3_moe"):
        kwargs.setdefault("head_dim", 16)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_model_with_tokenizer(path: Path, **overrides) -> Path:
    """A tiny random llama with the default model's tokenizer (so vocab_size is 49152)."""
    from config.default_model import resolve_model_path

    make_tiny_model(path, vocab_size=49152, **overrides)
    source = resolve_model_path(None)
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path
