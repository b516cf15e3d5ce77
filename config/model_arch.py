"""ModelArchConfig: the facts about a model's shape, parsed from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from config.hf_defaults import filled
from config.multimodal_text import text_only
from config.rope_arch import SUPPORTED_ROPE_TYPES, rope_context_len, rope_scaling, rotary_dim

__all__ = ["SUPPORTED_ROPE_TYPES", "ModelArchConfig"]


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """The architecture-level facts every process needs (no weights, no tokenizer)."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # How many last tokens the windowed layers attend to (None: every layer sees the whole context).
    sliding_window: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): the elements of the one vector each token
    # keeps per layer (kv_lora_rank + qk_rope_head_dim), shared by every head and every rank;
    # None: per-head keys and values. head_dim is then the rotary part (qk_rope_head_dim).
    kv_latent_dim: int | None = None
    # The whole config.json, for what only one family reads (a mixture of experts' routing, MLA's
    # ranks): each family parses its own fields in its own file (gpu_worker/models/).
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArchConfig:
        """Parse a Hugging Face config dict, with transformers' defaults for its model_type where
        a field is left out (config/hf_defaults.py; hf_config keeps them), a multimodal
        checkpoint served as text read from its text_config (config/multimodal_text.py); raises
        ValueError naming the source on bad input."""
        cfg = filled(text_only(cfg))
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(
                f"{source}: no 'architectures' entry; cannot tell which model to build"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        rope_params = cfg.get("rope_parameters") or {}
        # transformers 5 keeps rope_theta under rope_parameters; older configs keep it at top level.
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope_scaling(cfg, source)
        mla = _latent_attention(cfg, source)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=archs[0],
            model_type=cfg.get("model_type", ""),
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(mla[1] if mla else cfg.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=_sliding_window(cfg),
            kv_latent_dim=sum(mla) if mla else None,
            hf_config=dict(cfg),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        """Read <model_dir>/config.json; raises FileNotFoundError/ValueError naming the file."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        # ModelOpt's older exports describe their quantization in hf_quant_config.json alone;
        # vLLM reads it as quant_method modelopt, and so does config/quantization.py.
        quant = Path(model_dir) / "hf_quant_config.json"
        if "quantization_config" not in cfg and quant.is_file():
            try:
                cfg["quantization_config"] = {"quant_method": "modelopt"} | json.loads(
                    quant.read_text()
                )
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"{quant}: not a JSON object ({e})") from None
        arch = cls.from_dict(cfg, source=str(path))
        # generation_config.json's end ids join config.json's (or a family default's), as vLLM
        # adds them to the stop ids: instruct checkpoints list their end-of-turn token there
        # (Gemma's <end_of_turn>, Llama 3's <|eot_id|>).
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                eos = None  # generation_config.py reports a broken file where it reads it
            if eos is not None:
                more = [int(t) for t in (eos if isinstance(eos, list) else [eos])]
                ids = tuple(dict.fromkeys([*arch.eos_token_ids, *more]))
                arch = replace(arch, eos_token_ids=ids)
        return arch

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window layer layer_idx attends within (None: the whole context), as transformers
        decides per layer; a config built without its config.json (hf_config empty) slides every
        layer by sliding_window."""
        if not self.hf_config:
            return self.sliding_window
        return _layer_window(self.hf_config, layer_idx)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head the rotary embedding turns (head_dim unless the config's
        partial_rotary_factor says fewer: Phi-4-mini's 0.75); for a family that reads it."""
        return rotary_dim(self.hf_config, self.head_dim)

    @property
    def max_context_len(self) -> int:
        """The longest max_model_len accepted: max_position_embeddings, extended by linear,
        dynamic NTK and YaRN rope scaling as vLLM extends it (config/rope_arch.py)."""
        return rope_context_len(self.max_position_embeddings, self.rope_scaling)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V (MLA: of the latent vector) stored per token across all layers."""
        if self.kv_latent_dim is not None:
            return self.num_hidden_layers * self.kv_latent_dim
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def kv_elements_per_token_per_rank(self, tensor_parallel_size: int) -> int:
        """What one tensor-parallel rank stores per token: its share of the KV heads, or the
        whole latent vector (MLA), which every rank's query heads read."""
        if self.kv_latent_dim is not None:
            return self.kv_elements_per_token
        return self.kv_elements_per_token // tensor_parallel_size


def _latent_attention(cfg: dict[str, Any], source: str) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a model with multi-head latent attention (its
    config has kv_lora_rank), else None."""
    if cfg.get("kv_lora_rank") is None:
        return None
    rank: Any = cfg["kv_lora_rank"]
    rope: Any = cfg.get("qk_rope_head_dim")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rank, rope)):
        raise ValueError(
            f"{source}: kv_lora_rank (latent attention) needs an integer kv_lora_rank and "
            f"qk_rope_head_dim, not {rank!r} and {rope!r}"
        )
    return rank, rope


# Model types whose config turns the window on with use_sliding_window (off when absent) and
# keeps the first max_window_layers layers (28 when absent) full, as transformers' configs do.
_SWITCHED_WINDOW_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of a model whose config puts at least one layer in it (see _layer_window)."""
    layers = int(cfg["num_hidden_layers"])
    return next((w for i in range(layers) if (w := _layer_window(cfg, i)) is not None), None)


def _layer_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    """Layer layer_idx's window, decided as transformers does: Mistral's sliding_window slides
    every layer; Qwen2's and Qwen3's only when use_sliding_window, then the layers from
    max_window_layers on; layer_types, where given, names each layer's kind (transformers 5:
    gpt-oss alternates sliding and full layers)."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    switched = cfg.get("model_type") in _SWITCHED_WINDOW_TYPES
    # Only these configs read use_sliding_window (transformers' Mistral, Mixtral and gpt-oss
    # ignore the field).
    if switched and not cfg.get("use_sliding_window", False):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        used = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
    else:
        used = layer_idx >= int(cfg.get("max_window_layers", 28 if switched else 0))
    return int(window) if used else None
