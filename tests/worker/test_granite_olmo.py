"""Granite and OLMo 2 through the model runner equal transformers on tiny random models (fp32,
CPU): greedy tokens one request at a time, batched and in prompt chunks, the last-position
logits and the prompt logprobs; OLMo 2's whole-width q/k norms split over two ranks (gloo);
one `engine generate` run from the command line; and the config.json values the models cannot
run refused when the configuration resolves.

Each checkpoint is written by transformers in the test, with its biases and norm weights given
random values (transformers initialises them to 0 and 1) so that those paths matter, and
Granite's four multipliers far from 1 (each one changes transformers' logits: checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from engine_core.resolve import resolved_config
from kernels.cpu_binding import available as c_kernels_available
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, make_tiny_model_with_tokenizer
from tests.worker.runner_utils import (
    assert_last_logits_close,
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
    run_multiproc,
)

NEW_TOKENS = 10
PROMPT_LENS = (1, 7, 16, 45)
LOGIT_ATOL = 1e-4
GRANITE = dict(
    embedding_multiplier=6.0,
    residual_multiplier=0.3,
    attention_multiplier=0.08,
    logits_scaling=4.0,
    # Weights five times transformers' default spread: attention scores far from 0, so that
    # the attention scale (attention_multiplier) decides what the softmax picks.
    initializer_range=0.1,
)
HEAD64 = {"hidden_size": 256, "num_attention_heads": 4}

# name -> (family, overrides of the tiny config, the attention backend expected where the C
# kernels are built)
CASES = {
    "granite": ("granite", {**GRANITE, "tie_word_embeddings": True}, "torch"),
    "granite-bias-head64": ("granite", {**GRANITE, "attention_bias": True, **HEAD64}, "cpu"),
    "olmo2": ("olmo2", {}, "torch"),
    "olmo2-head64": ("olmo2", {**HEAD64, "attention_bias": True}, "cpu"),
}


def _perturb_constants(model_dir: Path) -> None:
    """Give biases and norm weights random values (transformers initialises them to 0 and 1)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = 0.5 * torch.randn(t.shape, generator=gen)
        elif name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


def _tiny(path: Path, family: str, **overrides) -> Path:
    model_dir = make_tiny_model(path, family, **overrides)
    _perturb_constants(model_dir)
    return model_dir


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(runner, driver, prompts, HF greedy tokens, HF full-sequence log-softmax, HF last logits)."""
    family, overrides, backend = CASES[request.param]
    model_dir = _tiny(tmp_path_factory.mktemp(request.param), family, **overrides)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.arch.architecture == {"granite": "GraniteForCausalLM"}.get(
        family, "Olmo2ForCausalLM"
    )
    if c_kernels_available():
        assert runner.backend.name == backend
    # The fused C decode step computes the plain pre-norm layer: these layers must not enter it.
    assert runner.model is not None and runner.model.fused_decode.stack() is None
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    tokens, logits = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    logprobs = {r: torch.log_softmax(x, dim=-1) for r, x in logits.items()}
    last_logits = {r: x[-1] for r, x in logits.items()}
    return runner, driver, prompts, tokens, logprobs, last_logits


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def test_one_request_at_a_time(case):
    _, driver, prompts, reference, _, _ = case
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    assert_same_tokens(outputs, reference)


def test_all_requests_in_one_batch(case):
    _, driver, prompts, reference, _, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


@pytest.mark.parametrize("chunk", [5, 16])
def test_prompts_split_into_chunks(case, chunk):
    _, driver, prompts, reference, _, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=chunk), reference)


def test_last_position_logits_match_transformers(case, monkeypatch):
    """The logits themselves (Granite's divided by logits_scaling), not only their argmax."""
    runner, driver, prompts, _, _, ref_last = case
    assert_last_logits_close(runner, driver, prompts, ref_last, LOGIT_ATOL, monkeypatch)


def test_prompt_logprobs_match_transformers(case):
    _, driver, prompts, _, ref_lp, _ = case
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, prompt_logprobs=3)
    driver.run(prompts, params, 1, chunk=6)
    for req_id, ids in prompts.items():
        got = driver.prompt_logprobs[req_id]
        expected = ref_lp[req_id][
            torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)
        ]
        torch.testing.assert_close(
            torch.tensor([lp[0] for lp in got.logprobs]), expected, rtol=0, atol=LOGIT_ATOL
        )


@pytest.mark.parametrize("multiplier", sorted(set(GRANITE) - {"initializer_range"}))
def test_each_granite_multiplier_changes_transformers_logits(tmp_path, multiplier):
    """The Granite cases above would fail with any one multiplier ignored: transformers' logits
    with it at 1.0 differ from those with the test's value."""
    model_dir = _tiny(tmp_path / "g", "granite", **GRANITE)
    ids = torch.tensor([random_prompts(512, (16,))["len16"]])
    with torch.inference_mode():
        used = hf_causal_lm(model_dir)(ids).logits[0]
        ignored = hf_causal_lm(model_dir, **{multiplier: 1.0})(ids).logits[0]
    assert (used - ignored).abs().max() > 0.1  # against LOGIT_ATOL 1e-4


@pytest.mark.parametrize("family", ["granite", "olmo2"])
def test_at_two_ranks_equals_transformers(tmp_path, family):
    """Greedy tokens through the multiprocess executor at TP=2 (gloo) equal transformers':
    OLMo 2's q_norm and k_norm span both ranks' heads (their sums of squares all-reduced);
    Granite's scalars apply to the ranks' summed outputs and gathered logits."""
    overrides = GRANITE if family == "granite" else {}
    model_dir = _tiny(tmp_path / family, family, attention_bias=True, **overrides)
    prompts = {k: v for k, v in random_prompts(512, PROMPT_LENS).items() if k in ("len7", "len45")}
    expected, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    outputs, _ = run_multiproc(model_dir, prompts, GREEDY, NEW_TOKENS, chunk=16)
    assert_same_tokens(outputs, expected)


@pytest.mark.parametrize("family", ["granite", "olmo2"])
def test_engine_generate_from_the_command_line(tmp_path, capsys, family):
    """`engine generate` on a tiny checkpoint with a real tokenizer prints the prompt and
    transformers' greedy continuation."""
    from transformers import AutoTokenizer

    from serve.cli import main

    overrides = GRANITE if family == "granite" else {}
    model_dir = make_tiny_model_with_tokenizer(tmp_path / family, arch=family, **overrides)
    _perturb_constants(model_dir)
    prompt = "Granite and OLMo 2 read the same tokens"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        seq = hf_causal_lm(model_dir).generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    expected = prompt + tokenizer.decode(seq[0, len(ids) :], skip_special_tokens=True)
    argv = ["generate", prompt, "--model", str(model_dir), "--max-tokens", str(NEW_TOKENS)]
    assert main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def _config_only(path: Path, family: str, **edits) -> Path:
    """A model directory with only config.json (load_format dummy), edited."""
    import transformers

    cls = {"granite": transformers.GraniteConfig, "olmo2": transformers.Olmo2Config}[family]
    arch = {"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM"}[family]
    cfg = cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ).to_dict()
    cfg.update(architectures=[arch], **edits)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("family", "edits", "words"),
    [
        ("granite", {"logits_scaling": 0.0}, "config.json: logits_scaling must be > 0, not 0.0"),
        ("granite", {"logits_scaling": -2}, "config.json: logits_scaling must be > 0, not -2"),
        ("granite", {"residual_multiplier": "x"}, "residual_multiplier must be a finite number"),
        ("granite", {"mlp_bias": True}, "config.json: mlp_bias true is not supported"),
        ("granite", {"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported"),
        ("olmo2", {"hidden_act": "relu"}, "config.json: hidden_act 'relu' is not supported"),
    ],
)
def test_values_the_models_cannot_run_are_refused_when_resolving(tmp_path, family, edits, words):
    folder = _config_only(tmp_path / family, family, **edits)
    with pytest.raises(ConfigError, match=words) as refusal:
        resolved_config(model=str(folder), device="cpu", load_format="dummy")
    assert str(refusal.value).startswith(f"model {family} (")
    assert "\n" not in str(refusal.value)
