"""The small mixture-of-experts model `engine bench throughput --small-moe` runs offline-mixed on:
a random-weight Qwen3-MoE (hidden 512, 4 layers, 16 experts of intermediate 512, top-2
renormalised, 8 query heads of 64, 2 KV heads) with the default model's tokenizer (so its
vocabulary, 49152), written with transformers once into the engine's cache so that both the
engine and transformers' generate load the same checkpoint.

Its router weights are transformers' initialisation (normal, std 0.02) scaled up 20x: at 0.02 the
router's scores are nearly uniform, and a trained router sends each token to a few experts with
clear preference; either way each step of 64 requests hits nearly every expert.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# The Qwen3-MoE config (the tokenizer's vocabulary and special ids are added from it).
SMALL_MOE: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1024,  # the dense MLP's; no layer is dense here
    moe_intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
ROUTER_SCALE = 20.0
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def write_small_moe(target: Path, seed: int = 0) -> Path:
    """Write the model (config.json, model.safetensors, the tokenizer) to target."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from config.default_model import resolve_model_path

    source = resolve_model_path(None)
    tokenizer_cfg = json.loads((source / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        **SMALL_MOE,
        vocab_size=tokenizer_cfg["vocab_size"],
        bos_token_id=tokenizer_cfg.get("bos_token_id"),
        eos_token_id=tokenizer_cfg.get("eos_token_id"),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(target, safe_serialization=True)
    path = target / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(".mlp.gate.weight"):
            tensors[name] = ROUTER_SCALE * tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    (target / _SHAPE_FILE).write_text(json.dumps(SMALL_MOE))
    return target


def small_moe_dir() -> str:
    """The small MoE model's directory in the engine's cache, written on first use."""
    from config.default_model import cache_root

    target = cache_root() / "models" / "small-moe"
    if not (target / "model.safetensors").is_file() or not _is_current(target):
        tmp = target.with_name("small-moe.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_small_moe(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return str(target)


_SHAPE_FILE = "bench-shape.json"  # SMALL_MOE as written (config.json renames some fields)


def _is_current(target: Path) -> bool:
    """Whether the cached model has SMALL_MOE's shape (a changed shape is written anew)."""
    try:
        return json.loads((target / _SHAPE_FILE).read_text()) == SMALL_MOE
    except (OSError, ValueError):
        return False
