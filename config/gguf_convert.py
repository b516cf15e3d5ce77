"""Convert a llama-architecture GGUF file into a Hugging Face-style fp32 model directory.

The directory also links its source file as model.gguf, which the loader reads instead of the
fp32 weights when they stay quantized (load_format 'gguf').

torch, gguf and safetensors are imported only when a tensor is converted: every process
resolves the model (the tokenizer process and the API servers too), and a converted model
needs none of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor

    from config.gguf_tensors import GGUFTensor

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
logger = logging.getLogger(__name__)

GGUF_LINK = "model.gguf"
# Only weights: llama.cpp also permutes Q/K biases, and Llama checkpoints carry none.
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_GLOBAL_RE = re.compile(r"(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its transformers Llama name; unknown names raise
    ValueError."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, kind = m.groups()
        if kind in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.weight"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}: no Llama equivalent")


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation, restoring the HF rotate_half row order."""
    # llama.cpp stores each head's rows as interleaved (even, odd) pairs:
    # w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2); this swaps them back.
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _fields(reader: GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _f32(value: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr turns 9.99999974e-06 back into 1e-05.
    return float(str(np.float32(value)))


def _build_config(meta: dict[str, Any], has_output: bool) -> dict[str, Any]:
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    vocab_size = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_row_order(rows: np.ndarray, name: str, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """The rows of HF tensor name as transformers has them: q and k rows un-permuted (rows may
    be floats or a quantized tensor's blocks)."""
    if name.endswith("q_proj.weight"):
        return unpermute_rotary_rows(rows, num_heads)
    if name.endswith("k_proj.weight"):
        return unpermute_rotary_rows(rows, num_kv_heads)
    return rows


def dense_tensor(
    tensor: ReaderTensor | GGUFTensor, name: str, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """A GGUF tensor dequantized to fp32 in Hugging Face row order."""
    import torch
    from gguf.quants import dequantize

    weight = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; numpy/torch want them slowest-first.
    weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    weight = hf_row_order(weight, name, num_heads, num_kv_heads)
    # A fresh array: F32 tensors come back as views of the reader's memory map.
    return torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))


def _load_tensors(
    reader: GGUFReader, names: list[str], config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    heads = config["num_attention_heads"], config["num_key_value_heads"]
    return {name: dense_tensor(tensor, name, *heads) for tensor, name in zip(reader.tensors, names)}


def _save_tokenizer(
    gguf_path: Path, meta: dict[str, Any], config: dict[str, Any], out: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(out))
    eos_id = config["eos_token_id"]
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        raise ValueError(
            f"{gguf_path}: converted tokenizer's eos {tokenizer.eos_token!r} has id "
            f"{tokenizer.eos_token_id}, GGUF says {eos_id}"
        )
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    # Loading kwargs leak into the saved config; they describe that load, not the tokenizer.
    tok_config.pop("is_local", None)
    tok_config.pop("local_files_only", None)
    # Readers that only look at tokenizer_config.json still find the template.
    if template := meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = template
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def link_source(model_dir: Path, gguf_path: Path) -> None:
    """model_dir/model.gguf -> gguf_path, replaced atomically when it points elsewhere."""
    link, target = model_dir / GGUF_LINK, gguf_path.resolve()
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = model_dir / f".{GGUF_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write gguf_path atomically as an fp32 LlamaForCausalLM directory out_dir; an existing one is
    kept (and its link to the source refreshed)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.is_dir():
        try:
            link_source(out_dir, gguf_path)
        except OSError as e:  # a read-only cache still serves the fp32 weights
            logger.warning(
                "cannot link %s into %s (%s): quantized loading will not find it",
                gguf_path,
                out_dir,
                e,
            )
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(gguf_path)
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    names = [hf_tensor_name(t.name) for t in reader.tensors]
    config = _build_config(meta, has_output="lm_head.weight" in names)
    tensors = _load_tensors(reader, names, config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _save_tokenizer(gguf_path, meta, config, tmp)
        link_source(tmp, gguf_path)
        # mkdtemp and safetensors create owner-only entries; model directories are normally
        # world-readable.
        for entry in tmp.iterdir():
            if not entry.is_symlink():  # chmod would follow the link to the source file
                entry.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another converter won the race; its complete directory is as good as ours.
            if not out_dir.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir
