"""MistralForCausalLM (registry.py: the Llama class, which gives each layer
cfg.layer_sliding_window(i)) equals transformers' greedy tokens: with sliding_window null (every
layer attends to the whole context), with a window shorter than the prompts, and with head_dim
given apart from hidden_size / num_attention_heads (Mistral NeMo and Small write it so), on the
torch attention backend and on the C one (head_dim 128). tests/worker/test_sliding_window_models.py
covers more window sizes, prompt logprobs and the fused C decode step."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.models.llama import LlamaForCausalLM
from kernels.cpu_binding import available as c_kernels_available
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import (
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 10
PROMPT_LENS = (5, 20, 41)
WINDOW = 8

# name -> (overrides of the tiny Mistral config, its layers' window, the backend expected where
# the C kernels are built)
CASES = {
    "no-window": ({"sliding_window": None}, None, "torch"),
    "window-head-dim": ({"sliding_window": WINDOW, "head_dim": 32}, WINDOW, "torch"),
    "window-head128": ({"sliding_window": WINDOW, "head_dim": 128}, WINDOW, "cpu"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(driver, prompts, transformers' greedy tokens)."""
    overrides, window, backend = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), "mistral", **overrides)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == overrides["sliding_window"]
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert isinstance(runner.model, LlamaForCausalLM)
    if c_kernels_available():
        assert runner.backend.name == backend
    assert runner.arch.head_dim == overrides.get("head_dim", 16)
    assert runner.arch.sliding_window == window
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [window] * len(layers)
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    model = hf_causal_lm(model_dir)
    reference, logits = hf_greedy(model, prompts, NEW_TOKENS)
    if window is not None:
        # The window matters: transformers without it computes other logits for the long prompt.
        ids = torch.tensor([prompts[f"len{PROMPT_LENS[-1]}"]])
        with torch.inference_mode():
            full = hf_causal_lm(model_dir, sliding_window=None)(ids).logits[0]
        assert (logits[f"len{PROMPT_LENS[-1]}"] - full).abs().max() > 1e-3
    return driver, prompts, reference


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def test_one_request_at_a_time(case):
    driver, prompts, reference = case
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    assert_same_tokens(outputs, reference)


@pytest.mark.parametrize("chunk", [None, 6])
def test_all_requests_in_one_batch(case, chunk):
    driver, prompts, reference = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=chunk), reference)
