"""What transformers fills in where a family's config.json leaves a field out.

A config.json written by hand or by an older tool may omit fields whose value transformers'
config class supplies; reading such a field with a default of our own would build another model
than transformers does, with no error. TRANSFORMERS_DEFAULTS copies the defaults of the fields the
engine reads from transformers 5.24's config classes (keyed by model_type, which picks the class),
and filled() applies them. tests/test_hf_defaults.py holds the table equal to the classes.
"""

from __future__ import annotations

from typing import Any

# gpt-oss's rotary embedding when config.json has none (GptOssConfig.__post_init__).
_GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}

# The MLA fields DeepseekV2Config and DeepseekV3Config share (q_lora_rank 1536: a config.json
# without it has the low-rank query projection; V2-Lite writes null).
_MLA: dict[str, Any] = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

# The fields Gemma2Config and Gemma3TextConfig share, with the values both default to (the
# model's sizes aside: a config.json without them is refused, as for every family).
_GEMMA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    # MistralConfig's: a 4096-token window on every layer unless config.json says null.
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6},
    "gemma2": {
        **_GEMMA,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    # Gemma 3's language model (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's
    # text_config: config/multimodal_text.py); its rotary bases are config/gemma_arch.py's.
    "gemma3_text": {
        **_GEMMA,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "granite": {
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "logits_scaling": 1.0,
        "hidden_act": "silu",
        "mlp_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
    },
    "olmo2": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
    },
    # Phi3Config: the original context is a top-level field with a default (LongRoPE reads it).
    "phi3": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "qwen3_moe": {
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    },
    "mixtral": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 1e6,
    },
    "gpt_oss": {
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "sliding_window": 128,
        "head_dim": 64,
        "attention_bias": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_parameters": _GPT_OSS_ROPE,
    },
    "deepseek_v2": {
        **_MLA,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "topk_method": "greedy",
        "moe_intermediate_size": 1407,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
    },
    "deepseek_v3": {
        **_MLA,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "rope_interleave": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    },
}

# transformers' attribute_map: a config.json may give a field under either name.
_ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_moe": {"num_local_experts": ("num_experts",)},
    "mixtral": {"num_local_experts": ("num_experts",)},
    # experts_per_token: OpenAI's original config.json.
    "gpt_oss": {
        "num_local_experts": ("num_experts",),
        "num_experts_per_tok": ("experts_per_token",),
    },
    "deepseek_v2": {"n_routed_experts": ("num_experts",)},
    "deepseek_v3": {"n_routed_experts": ("num_local_experts",)},
}


def filled(cfg: dict[str, Any], model_type: str | None = None) -> dict[str, Any]:
    """cfg with transformers' default for each field of TRANSFORMERS_DEFAULTS[model_type]
    (default: cfg's model_type) that cfg leaves out under all of its names; a field present,
    even as null, keeps its value. gpt-oss without layer_types alternates sliding and full
    layers from a sliding one, as GptOssConfig does; Gemma 2 and 3 as gemma_layer_types says.
    A new dict; cfg is not changed."""
    kind = cfg.get("model_type", "") if model_type is None else model_type
    out = dict(cfg)
    aliases = _ALIASES.get(kind, {})
    for name, value in TRANSFORMERS_DEFAULTS.get(kind, {}).items():
        if name in out or any(a in out for a in aliases.get(name, ())):
            continue
        out[name] = dict(value) if isinstance(value, dict) else value
    if kind == "gpt_oss" and out.get("layer_types") is None and "num_hidden_layers" in out:
        out["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(int(out["num_hidden_layers"]))
        ]
    if kind in _GEMMA_PATTERNS and out.get("layer_types") is None and "num_hidden_layers" in out:
        out["layer_types"] = gemma_layer_types(kind, out)
    if kind == "gemma3_text":
        _gemma3_rope_parameters(out)
    return out


# Every n-th Gemma layer attends to the whole context, the others within the sliding window:
# Gemma 2 alternates (n = 2), Gemma 3 reads sliding_window_pattern (6 where left out).
_GEMMA_PATTERNS = {"gemma2": 2, "gemma3_text": 6}


def gemma_layer_types(kind: str, cfg: dict[str, Any]) -> list[str]:
    """The layer_types Gemma2Config / Gemma3TextConfig give a config.json without them: layer i
    is full where (i + 1) is a multiple of the pattern, sliding otherwise."""
    pattern = _GEMMA_PATTERNS[kind]
    if kind == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", pattern))
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(int(cfg["num_hidden_layers"]))
    ]


_GEMMA3_KINDS = ("full_attention", "sliding_attention")


def _gemma3_rope_parameters(cfg: dict[str, Any]) -> None:
    """Gemma 3's two rotary embeddings as Gemma3TextConfig.convert_rope_params_to_dict reads
    them, in place: rope_parameters keyed by layer kind (transformers 5's config.json), the
    transformers 4 fields folded in (rope_scaling into the full layers', rope_theta, default
    1e6, as their base, rope_local_base_freq, default 1e4, as the sliding layers'). The
    top-level rope_scaling goes (its factor is already counted in max_position_embeddings,
    which vLLM does not extend either: ModelArchConfig.max_context_len stays it) and rope_theta
    is the full layers' base."""
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and any(k in params for k in _GEMMA3_KINDS)
    per_kind = {
        kind: dict((params.get(kind) if nested and isinstance(params, dict) else None) or {})
        for kind in _GEMMA3_KINDS
    }
    for kind in _GEMMA3_KINDS:
        per_kind[kind].setdefault("rope_type", "default")
    if cfg.get("rope_scaling"):
        per_kind["full_attention"].update(cfg["rope_scaling"])
    per_kind["full_attention"].setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    per_kind["sliding_attention"].setdefault(
        "rope_theta", cfg.get("rope_local_base_freq", 10_000.0)
    )
    cfg["rope_parameters"] = per_kind
    cfg.pop("rope_scaling", None)
    cfg["rope_theta"] = per_kind["full_attention"]["rope_theta"]
