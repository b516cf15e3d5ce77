"""Greedy tokens of tiny rope-scaled models equal transformers' in fp32 on the CPU: Qwen2 and
Qwen3 with YaRN and prompts beyond original_max_position_embeddings, and Llama with dynamic NTK
generating past max_position_embeddings (max_model_len raised into the extended context)."""

from __future__ import annotations

import pytest

from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import (
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 16
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}

# Weights large enough that the rotation decides tokens (at the default 0.02 a tiny model's
# attention is nearly uniform and other frequencies could give the same greedy tokens).
SHARP = {"initializer_range": 0.3}
CONTEXT = {"max_position_embeddings": 128, **SHARP}

# name -> (family, overrides, prompt lengths, engine args)
CASES = {
    "qwen2-yarn": ("qwen2", {"rope_parameters": YARN, **CONTEXT}, (40, 60), {}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN, **CONTEXT}, (45,), {}),
    "llama-dynamic": (
        "llama",
        {
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            "max_position_embeddings": 32,
            **SHARP,
        },
        (20, 28),
        {"max_model_len": 64},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers(tmp_path, name):
    family, overrides, lengths, engine_args = CASES[name]
    model_dir = make_tiny_model(tmp_path / name, family, **overrides)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB", **engine_args)
    scaling = runner.arch.rope_scaling
    assert scaling is not None and scaling["rope_type"] == overrides["rope_parameters"]["rope_type"]
    original = int(scaling.get("original_max_position_embeddings") or 32)
    # YaRN: prompts beyond the original context; dynamic NTK: generation beyond it.
    assert all(n + NEW_TOKENS > original for n in lengths)
    prompts = random_prompts(runner.arch.vocab_size, lengths)
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    assert_same_tokens(driver.run(prompts, greedy, NEW_TOKENS, chunk=9), reference)
    # The scaling decides tokens here: the same weights with the default rotary give others.
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled, _ = hf_greedy(hf_causal_lm(model_dir, rope_parameters=plain), prompts, NEW_TOKENS)
    assert unscaled != reference
