"""Qwen3-MoE and Mixtral through the model runner equal transformers on tiny random models.

Each case writes a small random checkpoint with transformers (tests/tiny_models.py), gives the
norm weights random values (transformers initialises them to 1) and the routers larger ones
(at transformers' 0.02 scale every token's router scores are nearly equal, so a wrong choice of
experts would hardly show), then checks greedy tokens (all prompts in one batch, and prompts in
chunks) and the last-position logits against transformers in fp32. Also: the layouts of the
checkpoints (per-expert tensors, transformers 5's stacked ones), a checkpoint missing an expert
tensor, config.json fields that are missing or wrong, and `engine generate` end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.models.blocks import GatedMLP
from gpu_worker.models.moe_block import SparseMoeBlock
from gpu_worker.models.weights import WeightLoadError
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, make_tiny_model_with_tokenizer
from tests.worker.runner_utils import (
    assert_last_logits_close,
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 8
PROMPT_LENS = (1, 7, 16, 45)
LOGIT_ATOL = 1e-4
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (family, overrides of the tiny config, kind of each layer's feed-forward block)
CASES = {
    # 8 experts, every layer sparse, top-2 weights renormalised.
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=8, norm_topk_prob=True, num_hidden_layers=3, **MOE),
        ("moe", "moe", "moe"),
    ),
    # Every second layer sparse (layers 1 and 3), weights not renormalised (the default).
    "qwen3_moe-sparse-step": (
        "qwen3_moe",
        dict(num_experts=4, decoder_sparse_step=2, num_hidden_layers=4, **MOE),
        ("dense", "moe", "dense", "moe"),
    ),
    # mlp_only_layers keeps layer 0 dense; top-3 of 6, renormalised.
    "qwen3_moe-mlp-only": (
        "qwen3_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            num_hidden_layers=3,
        ),
        ("dense", "moe", "moe"),
    ),
    "mixtral": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
        ("moe", "moe"),
    ),
    # A window of 8 on every layer, shorter than the 16- and 45-token prompts; head size 64
    # (the C attention kernel's where it is built).
    "mixtral-window": (
        "mixtral",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=8,
            hidden_size=256,
            num_attention_heads=4,
        ),
        ("moe", "moe"),
    ),
    "mixtral-8e-top1": (
        "mixtral",
        dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=32, num_hidden_layers=3),
        ("moe", "moe", "moe"),
    ),
}


def _perturb(model_dir: Path) -> None:
    """Norm weights random around 1; routers (mlp.gate, block_sparse_moe.gate) 20x larger."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.5 * torch.randn(t.shape, generator=gen)
        elif name.endswith(".gate.weight"):
            tensors[name] = 20.0 * t
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(runner, driver, prompts, HF greedy tokens, HF last logits)."""
    family, overrides, kinds = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    _perturb(model_dir)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    windows = {layer.self_attn.attn.sliding_window for layer in runner.model.model.layers}
    assert windows == {overrides.get("sliding_window")}
    blocks = [layer.mlp for layer in runner.model.model.layers]
    assert tuple("moe" if isinstance(b, SparseMoeBlock) else "dense" for b in blocks) == kinds
    assert all(isinstance(b, SparseMoeBlock | GatedMLP) for b in blocks)
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    tokens, logits = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    return runner, driver, prompts, tokens, {r: x[-1] for r, x in logits.items()}


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def test_all_requests_in_one_batch(case):
    _, driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


def test_prompts_split_into_chunks(case):
    _, driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=5), reference)


def test_last_position_logits_match_transformers(case, monkeypatch):
    runner, driver, prompts, _, ref_last = case
    assert_last_logits_close(runner, driver, prompts, ref_last, LOGIT_ATOL, monkeypatch)


def _expert_params(runner) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in runner.model.named_parameters()
        if ".experts." in n or ".gate." in n
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_expert_checkpoint_loads_the_same_weights(tmp_path, family):
    """transformers 5's own layout (save_original_format=False: mlp.experts.gate_up_proj
    [E, 2I, H], mlp.experts.down_proj [E, H, I], Mixtral's block named mlp) loads the same
    tensors as the per-expert checkpoint of the same model."""
    from transformers import AutoModelForCausalLM

    overrides = CASES[family][1]
    original = make_tiny_model(tmp_path / "original", family, **overrides)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    stacked = tmp_path / "stacked"
    model.save_pretrained(stacked, save_original_format=False)
    names = set(load_file(stacked / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any("block_sparse_moe" in n or ".experts.0." in n for n in names)
    got = _expert_params(make_runner(stacked, kv_cache_memory="4MiB")[0])
    want = _expert_params(make_runner(original, kv_cache_memory="4MiB")[0])
    assert got.keys() == want.keys() and got
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    ("family", "dropped", "named"),
    [
        (
            "qwen3_moe",
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight",
        ),
        # Mixtral's block is the layer's mlp in the model; the tensor is named as w1/w2/w3.
        (
            "mixtral",
            "model.layers.0.block_sparse_moe.experts.2.w2.weight",
            "model.layers.0.mlp.experts.2.w2.weight",
        ),
    ],
)
def test_checkpoint_missing_an_expert_tensor_is_refused_naming_it(tmp_path, family, dropped, named):
    model_dir = make_tiny_model(tmp_path, family, **CASES[family][1])
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors[dropped]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=f"missing tensors: {named}"):
        make_runner(model_dir, kv_cache_memory="4MiB")


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        # A field left out takes transformers' default (tests/test_family_config.py); a value
        # the model cannot use is refused.
        ("qwen3_moe", {"num_experts_per_tok": "2"}, "'num_experts_per_tok' must be an integer"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, "'moe_intermediate_size' must be an integer"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "'decoder_sparse_step' must be an integer >= 1"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "'mlp_only_layers' must be a list"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 8},
            "use_sliding_window is not supported",
        ),
        ("mixtral", {"num_local_experts": 0}, "'num_local_experts' must be an integer >= 1"),
        ("mixtral", {"num_experts_per_tok": 0}, "'num_experts_per_tok' must be an integer >= 1"),
        ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds"),
    ],
)
def test_invalid_moe_config_is_refused_naming_the_field(tmp_path, family, edit, message):
    """Refused when the configuration resolves (config/family_arch.py), before the model is
    built."""
    from config.errors import ConfigError
    from engine_core.resolve import resolved_config

    model_dir = make_tiny_model(tmp_path, family, **CASES[family][1])
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(edit)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        resolved_config(model=str(model_dir), device="cpu")


def test_qwen3_moe_reads_num_experts_as_released_configs_name_it(tmp_path):
    """Qwen3-30B-A3B's config.json says num_experts; transformers 5 writes num_local_experts."""
    model_dir = make_tiny_model(tmp_path, "qwen3_moe", **CASES["qwen3_moe"][1])
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg))
    runner, _ = make_runner(model_dir, kv_cache_memory="4MiB")
    moe = runner.model.model.layers[0].mlp.experts
    assert isinstance(moe, FusedMoE) and moe.num_experts == 8


@pytest.mark.parametrize("case_name", ["qwen3_moe", "mixtral"])
def test_engine_generate_equals_transformers(tmp_path, capsys, case_name):
    """`engine generate` on a tiny MoE with a real tokenizer prints transformers' text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.cli import main

    family, overrides, _ = CASES[case_name]
    model_dir = make_tiny_model_with_tokenizer(tmp_path, arch=family, **overrides)
    _perturb(model_dir)
    prompt = "The experts of a mixture"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    expected = prompt + tokenizer.decode(seq[0, len(ids) :], skip_special_tokens=True)
    rc = main(
        [
            "generate",
            prompt,
            "--model",
            str(model_dir),
            "--max-tokens",
            str(NEW_TOKENS),
            "--ignore-eos",
            "--device",
            "cpu",
            "--max-model-len",
            "64",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.rstrip("\n") == expected
