"""EAGLE and EAGLE-3 draft heads: their published checkpoint layouts, checked against the target.

A head is one (EAGLE: or a few) Llama decoder layer over the target's hidden states, in the
layouts the EAGLE authors publish (vLLM loads the same):
- EAGLE (yuhuili/EAGLE-LLaMA3-Instruct-8B): fc.weight [H, 2H] (fc.bias in some), then
  layers.<i>.* of Llama decoder layers, layer 0 without input_layernorm; the target's token
  embedding and output projection are shared (embed_tokens.weight used where the head has one).
- EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): fc.weight [H, 3H] over three of the target's
  intermediate hidden states, midlayer.* (hidden_norm, input_layernorm, q/k/v over 2H),
  norm.weight, lm_head.weight [draft_vocab_size, H], d2t (draft id -> target id offsets, where
  draft_vocab_size is below the target's vocabulary) and t2d (unused).
Each refusal is one line naming the head and what does not fit.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from config.attention import AttentionFeatures, attention_backends_for
from config.errors import ConfigError
from config.kv_window import freed_window
from config.model_arch import ModelArchConfig
from config.rope_arch import rope_context_len, rope_type

if TYPE_CHECKING:
    from config.engine import EngineConfig

# Rope types whose angles do not depend on max_position_embeddings: a head's table may be
# extended to the target's max_model_len.
_EXTENSIBLE_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class EagleHeadSpec:
    """What the worker builds: the head's layout, its decoder's shape and what it reads."""

    method: str  # eagle | eagle3
    arch: ModelArchConfig  # the head's config.json (its decoder layer's shape)
    num_layers: int
    fc_bias: bool
    own_embed: bool  # embed_tokens.weight in the head (else the target's is shared)
    draft_vocab_size: int  # EAGLE-3's output projection rows (EAGLE: the target's vocabulary)
    has_d2t: bool
    # EAGLE-3: the target layers whose input (the residual stream) the head reads, ascending.
    aux_layer_ids: tuple[int, ...]
    # The head's RotaryEmbedding max_positions: extended to max_model_len where the angles do
    # not depend on it (published heads say 2048 and serve longer contexts).
    rotary_positions: int


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's *.safetensors files, from their JSON headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a safetensors file ({e})") from None
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in info["shape"])
    return shapes


def check_eagle_head(config: EngineConfig) -> EagleHeadSpec:
    """The head --speculative-config names, checked against the target (config resolved up
    to the speculative part); raises ConfigError in one line."""
    spec, target = config.speculative, config.arch
    assert spec is not None and target is not None and spec.method in ("eagle", "eagle3")
    folder = Path(spec.model_path)
    name = f"speculative_config: {spec.method} head {spec.model}"
    try:
        arch = ModelArchConfig.from_model_dir(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{name}: {e}") from None
    hf = arch.hf_config
    hidden = target.hidden_size
    if arch.hidden_size != hidden or hf.get("target_hidden_size", hidden) != hidden:
        raise ConfigError(
            f"{name}: its hidden_size {arch.hidden_size} differs from the target's {hidden}"
        )
    if arch.vocab_size != target.vocab_size:
        raise ConfigError(
            f"{name}: its vocab_size {arch.vocab_size} differs from the target's "
            f"{target.vocab_size}; the head drafts in the target's vocabulary"
        )
    if target.rope_scaling is not None and rope_type(target.rope_scaling) == "longrope":
        raise ConfigError(f"{name}: a LongRoPE target's positions do not fit an EAGLE head")
    window = freed_window(config)
    if window is not None:
        raise ConfigError(
            f"{name}: the head attends to the whole context, but the target's sliding window "
            f"{window} frees the KV blocks behind it; lower max_model_len to {window}"
        )
    dummy = config.load.load_format == "dummy"
    shapes = {} if dummy else safetensors_shapes(folder)
    if not dummy and not shapes:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        found = f" (found {', '.join(pickles[:3])}: PyTorch pickles are not loaded)"
        raise ConfigError(
            f"{name}: no *.safetensors weights in {folder}{found if pickles else ''}; convert "
            f"a pickled head with python -m scripts.convert_eagle_head SRC DST"
        )
    layout = spec.method if dummy else _layout(shapes)
    if layout is None:
        raise ConfigError(
            f"{name}: not an EAGLE head in a published layout (fc.weight with layers.0.* or "
            f"midlayer.*); tensors: {', '.join(sorted(shapes)[:6])}"
        )
    if layout != spec.method:
        raise ConfigError(f"{name}: {folder} holds an {layout} head; use method {layout}")
    width = 2 if layout == "eagle" else 3
    fc = shapes.get("fc.weight", (hidden, width * hidden))
    if fc != (hidden, width * hidden):
        raise ConfigError(
            f"{name}: fc.weight {list(fc)} does not take {width} hidden states of the "
            f"target's size {hidden} ([{hidden}, {width * hidden}] expected)"
        )
    tp = config.parallel.tensor_parallel_size
    if arch.num_attention_heads % tp or arch.num_key_value_heads % tp:
        raise ConfigError(
            f"{name}: tensor_parallel_size {tp} must divide its {arch.num_attention_heads} "
            f"attention and {arch.num_key_value_heads} KV heads"
        )
    draft_vocab = int(hf.get("draft_vocab_size") or arch.vocab_size)
    if layout == "eagle3":
        _check_eagle3(name, shapes, arch, draft_vocab, dummy)
    aux = _aux_layers(name, hf, target.num_hidden_layers) if layout == "eagle3" else ()
    max_len = config.max_model_len
    rows = rope_context_len(arch.max_position_embeddings, arch.rope_scaling)
    extensible = arch.rope_scaling is None or rope_type(arch.rope_scaling) in _EXTENSIBLE_ROPE
    if rows < max_len and not extensible:
        raise ConfigError(
            f"{name}: its rotary embedding covers {rows} positions, fewer than max_model_len "
            f"{max_len}"
        )
    attention_backends_for(
        config.device_type,
        config.cache.block_size,
        arch.head_dim,
        config.torch_dtype_name,
        AttentionFeatures(kv_cache_dtype=config.cache.kv_cache_dtype),
    )
    return EagleHeadSpec(
        method=layout,
        arch=arch,
        num_layers=1 if layout == "eagle3" else arch.num_hidden_layers,
        fc_bias="fc.bias" in shapes,
        own_embed="embed_tokens.weight" in shapes,
        draft_vocab_size=draft_vocab,
        has_d2t="d2t" in shapes,
        aux_layer_ids=aux,
        rotary_positions=(
            max(arch.max_position_embeddings, max_len)
            if extensible
            else arch.max_position_embeddings
        ),
    )


def _layout(shapes: dict[str, tuple[int, ...]]) -> str | None:
    if "fc.weight" not in shapes:
        return None
    if any(n.startswith("midlayer.") for n in shapes):
        return "eagle3"
    if any(n.startswith("layers.0.") for n in shapes):
        return "eagle"
    return None


def _check_eagle3(
    name: str,
    shapes: dict[str, tuple[int, ...]],
    arch: ModelArchConfig,
    draft_vocab: int,
    dummy: bool,
) -> None:
    if arch.num_hidden_layers != 1:
        raise ConfigError(
            f"{name}: num_hidden_layers {arch.num_hidden_layers}; an EAGLE-3 head is one layer "
            f"(midlayer)"
        )
    if not 0 < draft_vocab <= arch.vocab_size:
        raise ConfigError(
            f"{name}: draft_vocab_size {draft_vocab} is not within the vocabulary "
            f"({arch.vocab_size})"
        )
    if dummy:
        return
    head = shapes.get("lm_head.weight")
    if head != (draft_vocab, arch.hidden_size):
        raise ConfigError(
            f"{name}: lm_head.weight {list(head or ())} is not [draft_vocab_size "
            f"{draft_vocab}, hidden_size {arch.hidden_size}]"
        )
    if draft_vocab < arch.vocab_size and shapes.get("d2t") != (draft_vocab,):
        raise ConfigError(
            f"{name}: draft_vocab_size {draft_vocab} is below the vocabulary "
            f"({arch.vocab_size}) and the head has no d2t [{draft_vocab}] to map its ids"
        )


def _aux_layers(name: str, hf: dict, num_layers: int) -> tuple[int, ...]:
    """The config's eagle_aux_hidden_state_layer_ids (top level or in eagle_config), else
    vLLM's default (2, L // 2, L - 3): three distinct target layers."""
    eagle_config = hf.get("eagle_config") or {}
    given = hf.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ids = tuple(int(i) for i in given) if given else (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        where = "its eagle_aux_hidden_state_layer_ids" if given else "the default layers"
        raise ConfigError(
            f"{name}: {where} {list(ids)} are not three distinct layers of the target's "
            f"{num_layers}; give eagle_aux_hidden_state_layer_ids in the head's config.json"
        )
    return tuple(sorted(ids))
