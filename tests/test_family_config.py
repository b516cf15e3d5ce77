"""The model families' own config.json fields at configuration time: what transformers fills in
where a field is left out (config/hf_defaults.py), and what the configuration refuses before any
process starts (config/family_arch.py), as one line from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from config.errors import ConfigError
from config.hf_defaults import TRANSFORMERS_DEFAULTS, filled
from config.mla_arch import MLAConfig
from config.model_arch import ModelArchConfig
from config.moe_arch import DeepseekMoEConfig, GptOssMoeConfig, MixtralMoeConfig, Qwen3MoeConfig
from engine_core.resolve import resolved_config

SMALL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)
CONFIGS: dict[str, tuple[type[transformers.PretrainedConfig], str, dict[str, Any]]] = {
    "granite": (transformers.GraniteConfig, "GraniteForCausalLM", {}),
    "gemma2": (transformers.Gemma2Config, "Gemma2ForCausalLM", dict(head_dim=16)),
    "gemma3_text": (transformers.Gemma3TextConfig, "Gemma3ForCausalLM", dict(head_dim=16)),
    "olmo2": (transformers.Olmo2Config, "Olmo2ForCausalLM", {}),
    "mistral": (transformers.MistralConfig, "MistralForCausalLM", {}),
    "phi3": (transformers.Phi3Config, "Phi3ForCausalLM", {}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    ),
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        "DeepseekV2ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            q_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
}


def _config_dict(model_type: str, **edits: Any) -> dict[str, Any]:
    """config.json as transformers writes it for a small model of model_type, with edits (None:
    the field left out)."""
    cls, arch, fields = CONFIGS[model_type]
    cfg = cls(**SMALL, **fields).to_dict()
    cfg["architectures"] = [arch]
    for key, value in edits.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_DEFAULTS))
def test_each_default_is_what_transformers_fills_in(model_type):
    """For every field of the table: config.json without it reads as transformers' config class
    reads it (the field's value in the class built from the same dict)."""
    cls = CONFIGS[model_type][0]
    for name, value in TRANSFORMERS_DEFAULTS[model_type].items():
        cfg = _config_dict(model_type, **{name: None})
        if name == "rope_theta":
            # transformers 5 keeps it in rope_parameters, which config.json leaves out too.
            cfg.pop("rope_parameters")
            theirs = cls.from_dict(cfg).rope_parameters["rope_theta"]
            ours = ModelArchConfig.from_dict(cfg).rope_theta
        else:
            theirs = getattr(cls.from_dict(cfg), name)
            ours = ModelArchConfig.from_dict(cfg).hf_config[name]
        assert ours == theirs == value, (model_type, name)


def test_gpt_oss_without_layer_types_alternates_from_a_sliding_layer():
    cfg = _config_dict("gpt_oss", layer_types=None, sliding_window=None)
    theirs = transformers.GptOssConfig.from_dict(cfg)
    assert (theirs.sliding_window, theirs.layer_types[:2]) == (
        128,
        ["sliding_attention", "full_attention"],
    )
    arch = ModelArchConfig.from_dict(cfg)
    windows = [arch.layer_sliding_window(i) for i in range(4)]
    assert windows == [128 if t == "sliding_attention" else None for t in theirs.layer_types]
    assert filled(cfg)["layer_types"] == theirs.layer_types
    assert arch.attention_bias and arch.head_dim == 16  # gpt-oss's attention_bias default True
    assert ModelArchConfig.from_dict(_config_dict("gpt_oss", head_dim=None)).head_dim == 64


def test_deepseek_routing_without_its_fields_as_transformers_reads_them():
    """DeepSeek-V3 without n_group/topk_group routes within 4 of 8 groups (DeepseekV3Config's
    defaults), not greedily; without the MLA fields, q_lora_rank is 1536, not None."""
    cfg = _config_dict("deepseek_v3", n_routed_experts=32, n_group=None, topk_group=None)
    theirs = transformers.DeepseekV3Config.from_dict(cfg)
    moe = DeepseekMoEConfig.from_hf(cfg, 3)
    assert moe.routing is not None
    assert (moe.routing.num_groups, moe.routing.topk_groups) == (theirs.n_group, theirs.topk_group)
    assert (moe.routing.num_groups, moe.routing.topk_groups) == (8, 4)
    for model_type in ("deepseek_v2", "deepseek_v3"):
        cfg = _config_dict(model_type, q_lora_rank=None)
        cls = CONFIGS[model_type][0]
        assert MLAConfig.from_hf(cfg).q_lora_rank == cls.from_dict(cfg).q_lora_rank == 1536
    v2 = _config_dict("deepseek_v2", topk_method=None, n_shared_experts=None)
    theirs2 = transformers.DeepseekV2Config.from_dict(v2)
    moe2 = DeepseekMoEConfig.from_hf(v2, 2)
    assert moe2.routing is not None and moe2.routing.num_groups == 1  # topk_method greedy
    assert moe2.num_shared_experts == theirs2.n_shared_experts == 2


def test_moe_fields_without_their_values_read_as_transformers():
    cfg = _config_dict("qwen3_moe", num_experts_per_tok=None, moe_intermediate_size=None)
    theirs = transformers.Qwen3MoeConfig.from_dict(cfg)
    cfg["num_local_experts"] = 256  # so that 8 of them fit
    qwen = Qwen3MoeConfig.from_hf(cfg)
    assert (qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (
        theirs.num_experts_per_tok,
        theirs.moe_intermediate_size,
    )
    cfg = _config_dict("mixtral", num_local_experts=None, num_experts_per_tok=None)
    theirs_m = transformers.MixtralConfig.from_dict(cfg)
    mixtral = MixtralMoeConfig.from_hf(cfg)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (
        theirs_m.num_local_experts,
        theirs_m.num_experts_per_tok,
    )
    cfg = _config_dict("gpt_oss", swiglu_limit=None, num_experts_per_tok=None)
    theirs_g = transformers.GptOssConfig.from_dict(cfg)
    gpt = GptOssMoeConfig.from_hf(cfg)
    assert (gpt.swiglu_limit, gpt.num_experts_per_tok) == (
        theirs_g.swiglu_limit,
        theirs_g.num_experts_per_tok,
    )


def test_use_sliding_window_is_read_only_where_transformers_reads_it():
    """Mistral's window slides every layer whatever use_sliding_window says (transformers'
    Mistral does not read it); Qwen2's is off without it."""
    mistral = transformers.MistralConfig(**SMALL, sliding_window=8).to_dict()
    mistral |= {"architectures": ["MistralForCausalLM"], "use_sliding_window": False}
    arch = ModelArchConfig.from_dict(mistral)
    assert arch.sliding_window == 8
    assert [arch.layer_sliding_window(i) for i in range(4)] == [8] * 4
    qwen2 = transformers.Qwen2Config(**SMALL, sliding_window=8).to_dict()
    qwen2 |= {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert ModelArchConfig.from_dict(qwen2).sliding_window is None


def _model_dir(tmp_path: Path, model_type: str, **edits: Any) -> Path:
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config_dict(model_type, **edits)))
    return folder


@pytest.mark.parametrize(
    ("model_type", "edits", "words"),
    [
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 8},
            "config.json: use_sliding_window is not supported for Qwen3-MoE",
        ),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "'decoder_sparse_step' must be an integer >= 1"),
        ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds"),
        ("mixtral", {"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported"),
        ("gpt_oss", {"swiglu_alpha": 1.5}, "config.json: swiglu_alpha 1.5 is not supported"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "config.json: topk_method 'noaux_tc'"),
        ("deepseek_v3", {"n_group": 3}, r"n_routed_experts \(8\) is not divisible by n_group"),
        ("deepseek_v3", {"qk_rope_head_dim": 9}, "qk_rope_head_dim must be even"),
    ],
)
def test_family_fields_the_model_cannot_run_are_refused_when_resolving(
    tmp_path, model_type, edits, words
):
    folder = _model_dir(tmp_path, model_type, **edits)
    with pytest.raises(ConfigError, match=words) as refusal:
        resolved_config(model=str(folder), device="cpu", load_format="dummy")
    assert str(refusal.value).startswith(f"model {model_type} ({CONFIGS[model_type][1]}): ")


@pytest.mark.parametrize(
    ("model_type", "edits", "parallel", "words"),
    [
        (
            "qwen3_moe",
            {"moe_intermediate_size": 33},
            {},
            r"expert width \(33, moe_intermediate_size or intermediate_size\) is not "
            r"divisible by tensor_parallel_size 2",
        ),
        (
            "mixtral",
            {"num_local_experts": 5},
            {"enable_expert_parallel": True},
            "config.json's 5 experts do not divide evenly over them",
        ),
    ],
)
def test_experts_that_do_not_split_over_the_ranks_are_refused_when_resolving(
    tmp_path, model_type, edits, parallel, words
):
    folder = _model_dir(tmp_path, model_type, **edits)
    with pytest.raises(ConfigError, match=words):
        resolved_config(
            model=str(folder), device="cpu", load_format="dummy", tensor_parallel_size=2, **parallel
        )
    # One rank holds every expert whole: nothing to split.
    resolved_config(model=str(folder), device="cpu", load_format="dummy", **parallel)


def test_a_dense_mlp_that_does_not_split_over_the_ranks_is_refused_when_resolving(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 129,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError,
        match=r"model llama \(LlamaForCausalLM\): config.json's intermediate_size \(129\) is "
        r"not divisible by tensor_parallel_size 2",
    ):
        resolved_config(
            model=str(folder), device="cpu", load_format="dummy", tensor_parallel_size=2
        )
    resolved_config(model=str(folder), device="cpu", load_format="dummy")


def test_cli_refuses_a_family_field_in_one_line_with_status_2(tmp_path, capsys):
    """The reviewer's reproduction: a tiny Qwen3-MoE with use_sliding_window printed two
    tracebacks and EngineDeadError from the engine core; now one line, exit status 2."""
    from serve.cli import main

    folder = _model_dir(tmp_path, "qwen3_moe", use_sliding_window=True, sliding_window=8)
    code = main(["generate", "hi", "--model", str(folder), "--load-format", "dummy"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("engine: error: model qwen3_moe (Qwen3MoeForCausalLM): config.json: ")
    assert "use_sliding_window" in err[0]


def test_generation_config_end_ids_join_the_configs(tmp_path):
    """A Gemma 3 config.json whose eos comes from the family default (1) still stops at
    generation_config.json's <end_of_turn> (106), as vLLM adds those ids to the stop ids."""
    import json

    from config.model_arch import ModelArchConfig

    cls, arch, fields = CONFIGS["gemma3_text"]
    cfg = cls(**{**SMALL, **fields}).to_dict()
    cfg["architectures"] = [arch]
    cfg.pop("eos_token_id", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert ModelArchConfig.from_model_dir(tmp_path).eos_token_ids == (1, 106)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 107}))
    assert ModelArchConfig.from_model_dir(tmp_path).eos_token_ids == (1, 107)
