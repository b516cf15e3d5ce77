"""Models with sliding-window layers equal transformers' greedy tokens with prompts longer than
the window: Mistral (every layer slides) and Qwen2/Qwen3 with use_sliding_window (the layers from
max_window_layers on), on the C attention backend (head_dim 64) and the torch one (other head
sizes), one request at a time, batched, and in prompt chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
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

NEW_TOKENS = 12
PROMPT_LENS = (20, 33, 45)
WINDOW = 8
HEAD64 = {"hidden_size": 256, "num_attention_heads": 4}
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}

# name -> (family, overrides, the backend expected to run it)
CASES = {
    "mistral-c": ("mistral", {"sliding_window": WINDOW, **HEAD64}, "cpu"),
    "mistral-torch": ("mistral", {"sliding_window": WINDOW}, "torch"),
    "qwen2-c": ("qwen2", {**QWEN_WINDOW, **HEAD64}, "cpu"),
    "qwen3-torch": ("qwen3", {**QWEN_WINDOW, "num_hidden_layers": 3}, "torch"),
}


def _hf_greedy(model_dir: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)[0]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(driver, prompts, transformers' greedy tokens, its prompt log-softmax per prompt)."""
    family, overrides, backend = CASES[request.param]
    if backend == "cpu" and not c_kernels_available():
        pytest.skip("no C compiler on this machine")
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.backend.name == backend
    arch = runner.arch
    windows = [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)]
    expected_windows = [
        WINDOW if family == "mistral" or i >= overrides["max_window_layers"] else None
        for i in range(arch.num_hidden_layers)
    ]
    assert windows == expected_windows
    assert runner.model is not None
    layers = runner.model.model.layers
    assert [ly.self_attn.attn.sliding_window for ly in layers] == windows
    prompts = random_prompts(arch.vocab_size, PROMPT_LENS)
    model = hf_causal_lm(model_dir)
    reference, logits = hf_greedy(model, prompts, NEW_TOKENS)
    # The window matters: transformers without it computes other logits for the long prompt.
    full_layers = {"layer_types": ["full_attention"] * arch.num_hidden_layers}
    no_window = full_layers if family != "mistral" else {"sliding_window": None}
    ids = torch.tensor([prompts[f"len{PROMPT_LENS[-1]}"]])
    with torch.inference_mode():
        full = hf_causal_lm(model_dir, **no_window)(ids).logits[0]
    assert (logits[f"len{PROMPT_LENS[-1]}"] - full).abs().max() > 1e-3
    logprobs = {r: torch.log_softmax(x, dim=-1) for r, x in logits.items()}
    return driver, prompts, reference, logprobs


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


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
    """Every prompt position's logprobs (windows change them where greedy tokens may not)."""
    driver, prompts, _, ref_lp = case
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, prompt_logprobs=3)
    driver.run(prompts, params, 1, chunk=6)
    for req_id, ids in prompts.items():
        got = driver.prompt_logprobs[req_id]
        expected = ref_lp[req_id][torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(
            torch.tensor([lp[0] for lp in got.logprobs]), expected, rtol=0, atol=1e-4
        )


def test_torch_backend_runs_the_head64_models_too(tmp_path):
    """The same head_dim-64 Mistral on the torch backend (the C one is preferred there)."""
    model_dir = make_tiny_model(tmp_path / "m", "mistral", sliding_window=WINDOW, **HEAD64)
    _, driver = make_runner(model_dir, TorchAttentionBackend(), kv_cache_memory="4MiB")
    gen = torch.Generator().manual_seed(3)
    prompts = {"a": torch.randint(3, 512, (29,), generator=gen).tolist()}
    expected = _hf_greedy(model_dir, prompts)
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=7), expected)


@pytest.mark.skipif(not c_kernels_available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("window", [8, 24, 40])
def test_fused_decode_stack_attends_within_the_window(tmp_path, monkeypatch, window):
    """The fused C decode stack takes every decode step of a windowed model (its parts split the
    window, not the context) and equals transformers; windows shorter than, around and longer
    than the 16-position pieces and the 17 + 12 tokens."""
    model_dir = make_tiny_model(tmp_path / "m", "mistral", sliding_window=window, **HEAD64)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    assert runner.model is not None
    stack = runner.model.fused_decode.stack()
    assert stack is not None, "a Mistral layer stack the fused kernel takes"
    lengths: list[int] = []
    run = type(stack).run

    def counting(self, x, cos, sin, slots, block_table, seq_lens):
        lengths.append(int(seq_lens.max()))
        return run(self, x, cos, sin, slots, block_table, seq_lens)

    monkeypatch.setattr(type(stack), "run", counting)
    gen = torch.Generator().manual_seed(5)
    prompts = {"a": torch.randint(3, 512, (17,), generator=gen).tolist()}
    prompts["b"] = torch.randint(3, 512, (33,), generator=gen).tolist()
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), _hf_greedy(model_dir, prompts))
    # Every decode step (contexts 18..44 tokens) went through the fused kernel.
    assert len(lengths) == NEW_TOKENS - 1 and max(lengths) == 33 + NEW_TOKENS - 1
