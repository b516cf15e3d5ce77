"""Gemma 2 and Gemma 3 (text) equal transformers: tiny random models built here with transformers
(fp32, eager attention), prompts longer than the sliding window, greedy tokens and prompt
logprobs through the model runner on the C attention backend (head_dim 64) and the torch one
(head_dim 32), one request at a time, batched and in chunks; Gemma 3 from a transformers 4
config.json too; Gemma3ForConditionalGeneration served as text (both tensor namings); `engine
generate` on a Gemma 2 with a tokenizer; and the config values the engine refuses.

The random weights are made to exercise what Gemma adds: norm weights away from 0 (the norms
scale by 1 + w), q and k projections large enough that attention scores reach the soft cap,
and small caps, so that a model without any one of them gives other logits (checked)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from config.errors import ConfigError
from config.hf_defaults import filled
from config.kv_window import model_wide_window
from config.model_arch import ModelArchConfig
from engine_core.resolve import resolved_config
from kernels.cpu_binding import available as c_kernels_available
from protocol.sampling_params import SamplingParams
from tests.worker.runner_utils import (
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 12
PROMPT_LENS = (20, 33, 45)
WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
SMALL: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    sliding_window=WINDOW,
    query_pre_attn_scalar=40,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)
GEMMA3_LAYERS = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
GEMMA3_LAYERS.append("full_attention")
# Full layers: theta 10000 with linear scaling 4; sliding layers: their own base, unscaled.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}


def _gemma2_config(head_dim: int):
    import transformers

    return transformers.Gemma2Config(
        **SMALL,
        head_dim=head_dim,
        num_hidden_layers=4,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=2.0,
    )


def _gemma3_config(head_dim: int, **fields):
    import transformers

    return transformers.Gemma3TextConfig(
        **SMALL,
        head_dim=head_dim,
        num_hidden_layers=6,
        layer_types=GEMMA3_LAYERS,
        rope_parameters=json.loads(json.dumps(GEMMA3_ROPE)),
        **fields,
    )


def _perturb(model: torch.nn.Module) -> None:
    """Norm weights w ~ N(0, 0.3) (the norms scale by 1 + w); q and k projections times 6."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            elif ".q_proj." in name or ".k_proj." in name:
                param.mul_(6.0)


def make_gemma(path: Path, version: int, head_dim: int = 64, **fields) -> Path:
    """A tiny random Gemma2ForCausalLM or Gemma3ForCausalLM saved to path (fp32)."""
    import transformers

    if version == 2:
        cfg, cls = _gemma2_config(head_dim), transformers.Gemma2ForCausalLM
    else:
        cfg, cls = _gemma3_config(head_dim, **fields), transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32)
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _eager(model_dir: Path, **kwargs):
    return hf_causal_lm(model_dir, attn_implementation="eager", **kwargs)


# name -> (Gemma version, head_dim, the backend expected to run it)
CASES = {
    "gemma2-c": (2, 64, "cpu"),
    "gemma2-torch": (2, 32, "torch"),
    "gemma3-c": (3, 64, "cpu"),
    "gemma3-torch": (3, 32, "torch"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(driver, prompts, transformers' greedy tokens, its prompt log-softmax per prompt)."""
    version, head_dim, backend = CASES[request.param]
    if backend == "cpu" and not c_kernels_available():
        pytest.skip("no C compiler on this machine")
    model_dir = make_gemma(tmp_path_factory.mktemp(request.param), version, head_dim)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.backend.name == backend
    prompts = random_prompts(512, PROMPT_LENS)
    model = _eager(model_dir)
    reference, logits = hf_greedy(model, prompts, NEW_TOKENS)
    # What Gemma adds matters here: transformers without the window, or without the caps
    # (Gemma 2), computes other logits for the longest prompt.
    ids = torch.tensor([prompts[f"len{PROMPT_LENS[-1]}"]])
    layers = 4 if version == 2 else 6
    variants: list[dict[str, Any]] = [{"layer_types": ["full_attention"] * layers}]
    if version == 2:
        variants += [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]
    for variant in variants:
        with torch.inference_mode():
            other = _eager(model_dir, **variant)(ids).logits[0]
        assert (logits[f"len{PROMPT_LENS[-1]}"] - other).abs().max() > 1e-3, variant
    logprobs = {r: torch.log_softmax(x, dim=-1) for r, x in logits.items()}
    return driver, prompts, reference, logprobs


def test_one_request_at_a_time(case):
    driver, prompts, reference, _ = case
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    assert_same_tokens(outputs, reference)


def test_all_requests_in_one_batch(case):
    driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


@pytest.mark.parametrize("chunk", [5, 16])
def test_prompts_split_into_chunks(case, chunk):
    driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=chunk), reference)


def test_prompt_logprobs_match_transformers(case):
    """Every prompt position's logprob of the next prompt token (soft-capped logits included)."""
    driver, prompts, _, ref_lp = case
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, prompt_logprobs=3)
    driver.run(prompts, params, 1, chunk=6)
    for req_id, ids in prompts.items():
        got = driver.prompt_logprobs[req_id]
        expected = ref_lp[req_id][torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(
            torch.tensor([lp[0] for lp in got.logprobs]), expected, rtol=0, atol=1e-4
        )


def test_layers_as_the_config_says(tmp_path):
    """Gemma 3's windows, scale and rotary embeddings per layer, as transformers' config gives
    them: sliding layers share one rotary embedding of their own base, full layers the
    model's (linear scaling)."""
    model_dir = make_gemma(tmp_path / "g3", 3)
    runner, _ = make_runner(model_dir, kv_cache_memory="4MiB", load_format="dummy")
    model = runner.model
    assert model is not None
    layers = list(model.model.layers)
    windows = [ly.self_attn.attn.sliding_window for ly in layers]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in GEMMA3_LAYERS]
    assert {ly.self_attn.attn.scale for ly in layers} == {40**-0.5}
    assert {ly.self_attn.attn.logits_soft_cap for ly in layers} == {None}
    sliding = {id(r) for r, t in zip(model.layer_rotaries, GEMMA3_LAYERS) if t[0] == "s"}
    full = {id(r) for r, t in zip(model.layer_rotaries, GEMMA3_LAYERS) if t[0] == "f"}
    assert len(sliding) == 1 and full == {id(model.rotary)}
    positions = torch.tensor([3])
    local = model.layer_rotaries[0]
    torch.testing.assert_close(local.cos[3, :1], torch.cos(torch.tensor([3.0])))
    inv_freq_1 = 100.0 ** (-2 / 64)  # the sliding base's second frequency
    torch.testing.assert_close(local.cos[positions, 1], torch.cos(3 * torch.tensor([inv_freq_1])))
    inv_freq_1 = 10000.0 ** (-2 / 64) / 4  # the full layers' base, positions divided by 4
    torch.testing.assert_close(
        model.rotary.cos[positions, 1], torch.cos(3 * torch.tensor([inv_freq_1]))
    )
    # max_position_embeddings already counts the linear factor: neither the context nor the
    # table grows by it (vLLM's max_model_len for Gemma 3 is max_position_embeddings too).
    assert runner.arch.max_context_len == 512 and runner.arch.rope_scaling is None
    assert runner.arch.rope_theta == 10000.0  # the full layers' base
    assert model.rotary.cos.shape[0] == local.cos.shape[0] == 512


def _transformers4_gemma3(model_dir: Path) -> None:
    """Rewrite a Gemma 3 config.json as Google's checkpoints (transformers 4) write it: rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern at the top level, no
    layer_types nor rope_parameters."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for name in ("layer_types", "rope_parameters"):
        cfg.pop(name)
    cfg.update(
        rope_theta=10000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,
    )
    path.write_text(json.dumps(cfg))


def test_gemma3_from_a_transformers4_config(tmp_path):
    model_dir = make_gemma(tmp_path / "g3", 3)
    _transformers4_gemma3(model_dir)
    model = _eager(model_dir)
    assert model.config.layer_types == GEMMA3_LAYERS  # sliding_window_pattern 3 says the same
    assert model.config.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
    prompts = random_prompts(512, (30,), seed=4)
    reference, _ = hf_greedy(model, prompts, NEW_TOKENS)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.arch.max_context_len == 512 and runner.arch.rope_theta == 10000.0
    assert [runner.arch.layer_sliding_window(i) for i in range(6)] == [
        WINDOW if t == "sliding_attention" else None for t in GEMMA3_LAYERS
    ]
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=7), reference)


def make_gemma3_multimodal(path: Path) -> Path:
    """A tiny random Gemma3ForConditionalGeneration (a SigLIP tower of one layer) saved to
    path: its language model is _gemma3_config(64)'s."""
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    cfg = transformers.Gemma3Config(
        text_config=_gemma3_config(64).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=498,
        eoi_token_index=499,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _google_tensor_names(model_dir: Path) -> None:
    """Rename the saved tensors as Google's Gemma 3 checkpoints name them (transformers 4):
    language_model.model.*, vision_tower.*, multi_modal_projector.*."""
    from safetensors.torch import load_file, save_file

    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {}
        for name, tensor in tensors.items():
            if name.startswith("model.language_model."):
                name = "language_model.model." + name.removeprefix("model.language_model.")
            elif name.startswith("model."):
                name = name.removeprefix("model.")
            renamed[name] = tensor
        save_file(renamed, path, metadata={"format": "pt"})


@pytest.mark.parametrize("naming", ["transformers5", "google"])
def test_gemma3_conditional_generation_served_as_text(tmp_path, naming):
    """The image-text checkpoint's language model answers a text prompt as transformers'
    Gemma3ForConditionalGeneration does; the vision tensors are skipped."""
    import transformers

    model_dir = make_gemma3_multimodal(tmp_path / "mm")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts(490, (25, 40), seed=6)
    reference, _ = hf_greedy(model, prompts, NEW_TOKENS)
    if naming == "google":
        _google_tensor_names(model_dir)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.arch.architecture == "Gemma3ForConditionalGeneration"
    assert runner.arch.hidden_size == 128 and runner.arch.head_dim == 64
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_engine_generate_cli(tmp_path, capsys):
    """`engine generate` on a Gemma 2 with the default model's tokenizer prints transformers'
    greedy continuation."""
    import transformers
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path
    from serve.cli import main

    cfg = _gemma2_config(64)
    cfg.vocab_size = 49152
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(cfg).to(torch.float32)
    _perturb(hf)
    model_dir = tmp_path / "gemma2"
    hf.save_pretrained(model_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(resolve_model_path(None) / name, model_dir / name)
    prompt = "Gemma two caps its attention logits and slides a window over the prompt"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > WINDOW
    with torch.inference_mode():
        seq = _eager(model_dir).generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    expected = prompt + tokenizer.decode(seq[0, len(ids) :], skip_special_tokens=True)
    argv = ["generate", prompt, "--model", str(model_dir), "--max-tokens", str(NEW_TOKENS)]
    assert main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


# Configuration: transformers' defaults and the values the engine refuses.


def test_layer_types_left_out_are_transformers(tmp_path):
    import transformers

    for cls, model_type, fields in (
        (transformers.Gemma2Config, "gemma2", {}),
        (transformers.Gemma3TextConfig, "gemma3_text", {}),
        (transformers.Gemma3TextConfig, "gemma3_text", {"sliding_window_pattern": 4}),
    ):
        cfg = cls(**SMALL, num_hidden_layers=9).to_dict()
        cfg.pop("layer_types")
        cfg.update(fields)
        theirs = cls.from_dict(cfg).layer_types
        assert filled(cfg)["layer_types"] == theirs, (model_type, fields)
        # Each layer's window follows them; with full layers among them no KV block is freed
        # behind the window (config/kv_window.py: a hybrid model keeps every block).
        cfg["architectures"] = [
            "Gemma2ForCausalLM" if model_type == "gemma2" else "Gemma3ForCausalLM"
        ]
        arch = ModelArchConfig.from_dict(cfg)
        windows = [arch.layer_sliding_window(i) for i in range(9)]
        assert windows == [WINDOW if t == "sliding_attention" else None for t in theirs]
        assert model_wide_window(arch, 512) is None


def _config_only(path: Path, version: int, **edits: Any) -> Path:
    """A model directory with only config.json (load_format dummy), edited (None: removed)."""
    cfg = (_gemma2_config(64) if version == 2 else _gemma3_config(64)).to_dict()
    cfg["architectures"] = [f"Gemma{version}ForCausalLM"]
    for key, value in edits.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("version", "edits", "words"),
    [
        (2, {"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
        (3, {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
        (2, {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        (2, {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive"),
        (3, {"layer_types": ["chunked_attention"] * 6}, "layer_types must name each"),
        (
            3,
            {"rope_parameters": {"full_attention": {"rope_type": "mrope", "rope_theta": 1e6}}},
            "rope scaling type 'mrope' is not supported",
        ),
    ],
)
def test_what_the_model_classes_cannot_build_is_refused(tmp_path, version, edits, words):
    model = _config_only(tmp_path / "m", version, **edits)
    with pytest.raises(ConfigError, match=words) as refused:
        resolved_config(model=str(model), device="cpu", load_format="dummy")
    assert f"Gemma{version}ForCausalLM" in str(refused.value)


def test_intermediate_size_must_split_over_the_ranks(tmp_path):
    model = _config_only(tmp_path / "m", 2, intermediate_size=255)
    with pytest.raises(ConfigError, match="intermediate_size \\(255\\) is not divisible"):
        resolved_config(model=str(model), device="cpu", load_format="dummy", tensor_parallel_size=2)


@pytest.mark.parametrize("version", [2, 3])
def test_bfloat16_norms_keep_one_plus_w_in_fp32(tmp_path, version):
    """In bf16 the norms' 1 + w stays fp32 (transformers computes it in fp32 at every call) and
    the model's first-token logprobs are within bf16's tolerance of fp32's (torch backend)."""
    from tests.worker.runner_utils import assert_first_logprobs_close

    model_dir = make_gemma(tmp_path / f"g{version}", version, head_dim=32)
    runner, bf16 = make_runner(model_dir, kv_cache_memory="4MiB", dtype="bfloat16")
    assert runner.model is not None
    norms = [m for n, m in runner.model.named_modules() if n.endswith("norm")]
    assert len(norms) == 1 + (4 + 2 * (version == 3)) * runner.arch.num_hidden_layers
    assert {m.weight.dtype for m in norms} == {torch.float32}
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    _, fp32 = make_runner(model_dir, kv_cache_memory="4MiB")
    assert_first_logprobs_close(bf16, fp32, random_prompts(512, (9, 30), seed=2))
