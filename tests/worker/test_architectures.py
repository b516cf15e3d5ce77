"""Every supported architecture through the model runner equals transformers on tiny random models.

Each case writes a small random checkpoint with transformers (tests/tiny_models.py), perturbs
the tensors transformers initialises to constants (biases to 0, norm weights to 1) so the q/k/v
bias and q/k norm paths matter, and checks greedy tokens (one request at a time, all in one
batch, prompts in chunks), the last-position logits and the prompt logprobs against transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import (
    assert_last_logits_close,
    assert_same_tokens,
    capture_logits,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 10
PROMPT_LENS = (1, 7, 16, 45)  # one token, under a block, exactly one block, more than two blocks
LOGIT_ATOL = 1e-4

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

# name -> (family, overrides of the tiny config, rewrite config.json in the pre-v5 rope layout)
CASES = {
    "llama": ("llama", {}, False),
    "qwen2": ("qwen2", {}, False),  # biases on q, k, v
    "qwen3": ("qwen3", {}, False),  # RMSNorm on q and k heads
    "mistral": ("mistral", {}, False),
    # Head sizes the CPU C attention kernel takes (64, 128); the others run the torch backend.
    "qwen2-head64": ("qwen2", {"hidden_size": 256, "num_attention_heads": 4}, False),
    "qwen3-head128": ("qwen3", {"head_dim": 128}, False),
    "llama-untied": ("llama", {"tie_word_embeddings": False}, False),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, False),
    "llama-attention-bias": ("llama", {"attention_bias": True}, False),  # q/k/v and o biases
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, False),
    "llama3-rope-legacy": ("llama", {"rope_parameters": LLAMA3_ROPE}, True),
    "linear-rope": (
        "llama",
        {"rope_parameters": dict(rope_type="linear", rope_theta=10000.0, factor=4.0)},
        False,
    ),
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


def _to_legacy_rope(model_dir: Path) -> None:
    """Rewrite config.json as older checkpoints have it: rope_scaling and a top-level rope_theta."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(runner, driver, prompts, HF greedy tokens, HF full-sequence log-softmax, HF last logits)."""
    family, overrides, legacy = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    _perturb_constants(model_dir)
    if legacy:
        _to_legacy_rope(model_dir)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    if "rope_parameters" in overrides:
        assert runner.arch.rope_scaling is not None
        assert runner.arch.rope_scaling["rope_type"] == overrides["rope_parameters"]["rope_type"]
    assert runner.arch.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    from kernels.cpu_binding import available

    if available():
        assert runner.backend.name == ("cpu" if runner.arch.head_dim in (64, 128) else "torch")

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
    runner, driver, prompts, _, _, ref_last = case
    assert_last_logits_close(runner, driver, prompts, ref_last, LOGIT_ATOL, monkeypatch)


def test_prompt_logprobs_match_transformers(case):
    _, driver, prompts, _, ref_lp, _ = case
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, prompt_logprobs=4)
    driver.run(prompts, params, 1, chunk=6)
    for req_id, ids in prompts.items():
        got = driver.prompt_logprobs[req_id]
        ref = ref_lp[req_id]
        assert len(got.token_ids) == len(ids) - 1
        for pos in range(len(ids) - 1):
            assert got.token_ids[pos][0] == ids[pos + 1]
            assert abs(got.logprobs[pos][0] - ref[pos, ids[pos + 1]].item()) < LOGIT_ATOL
            assert torch.allclose(
                torch.tensor(got.logprobs[pos][1:]), ref[pos].topk(4).values, atol=LOGIT_ATOL
            )


def test_dummy_load_format_needs_only_config(tmp_path, monkeypatch):
    """load_format='dummy' builds the model from config.json alone and fills random weights."""
    import transformers

    model_dir = tmp_path / "config-only"
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(model_dir)
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]

    runner, driver = make_runner(model_dir, load_format="dummy", kv_cache_memory="4MiB")
    captured = capture_logits(runner, monkeypatch)
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    outputs = driver.run(prompts, GREEDY, 4, chunk=8)
    assert all(len(o) == 4 and all(0 <= t < 512 for t in o) for o in outputs.values())
    assert captured and all(torch.isfinite(c).all() for c in captured)
    assert all(c.shape[-1] == 512 for c in captured)
    # Random weights, not a constant: the logits of a step are not all equal.
    assert not math.isclose(captured[0].std().item(), 0.0, abs_tol=1e-6)
