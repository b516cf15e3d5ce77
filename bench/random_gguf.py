"""A GGUF file of random quantized weights in a model's shape, for timing the quantized path
(`engine bench device --gguf-type`): random codes with small, finite scales, norms of ones.

The engine resolves a .gguf model by converting it once into a cache directory; for a timing
run prepare_cache_dir() writes that directory's config.json (and the link to the file) itself,
since the fp32 conversion of an 8B model would take 32 GB and is never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from config.default_model import gguf_cache_dir
from config.gguf_convert import GGUF_LINK

# Byte offsets of each type's fp16 scale fields within a block (codes elsewhere stay random).
_SCALE_FIELDS = {
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def random_blocks(qtype: GGMLType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A random [n, k] weight as qtype's bytes, [n, row bytes]; every fp16 scale 1e-3."""
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} needs rows of whole {block}-column blocks, not {k}")
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scale = np.full((n, k // block), 1e-3, np.float16).view(np.uint8).reshape(n, k // block, 2)
    for at in _SCALE_FIELDS.get(qtype, (0,)):
        raw[..., at : at + 2] = scale
    return raw.reshape(n, -1)


def _tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """GGUF tensor kind -> [out, in] of a Llama config."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (i, h),
        "ffn_up": (i, h),
        "ffn_down": (h, i),
    }


def write_random_gguf(path: Path, config: dict[str, Any], qtype: GGMLType, seed: int = 0) -> Path:
    """Every projection, the embedding and the output projection of config's Llama as random
    qtype blocks; the norms fp32 ones."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    h, vocab = config["hidden_size"], config["vocab_size"]
    for name in ("token_embd", "output"):
        writer.add_tensor(f"{name}.weight", random_blocks(qtype, vocab, h, rng), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for layer in range(config["num_hidden_layers"]):
        for kind, (n, k) in _tensor_shapes(config).items():
            raw = random_blocks(qtype, n, k, rng)
            writer.add_tensor(f"blk.{layer}.{kind}.weight", raw, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prepare_cache_dir(gguf_path: Path, config: dict[str, Any]) -> Path:
    """The directory the engine resolves gguf_path to (under ENGINE_CACHE_DIR), holding config
    and the link to the file, as conversion would leave it (without the fp32 weights)."""
    directory = gguf_cache_dir(gguf_path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / GGUF_LINK).symlink_to(gguf_path.resolve())
    return directory


def quantized_bytes_per_step(config: dict[str, Any], qtype: GGMLType, dtype_bytes: int) -> int:
    """Bytes one decode step reads: every projection and the output projection in qtype's
    blocks, the norms in the model's dtype (the embedding only a row per request: left out)."""
    block, size = GGML_QUANT_SIZES[qtype]
    h, vocab = config["hidden_size"], config["vocab_size"]
    per_layer = sum(n * k for n, k in _tensor_shapes(config).values())
    weights = config["num_hidden_layers"] * per_layer + vocab * h
    norms = (2 * config["num_hidden_layers"] + 1) * h
    return weights // block * size + norms * dtype_bytes
