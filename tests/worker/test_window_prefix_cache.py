"""Prefix-cache hits on models with sliding windows and sinks: requests sharing a prefix longer
than the window start from its cached blocks (their first computed query's window lies wholly in
those blocks) and still give transformers' greedy tokens. Tiny Mistral (every layer slides by 8)
on the C backend (head_dim 64) and the torch one (head_dim 16), and a tiny gpt-oss (sinks,
sliding layers alternating with full ones), through the offline LLM with prefix caching on."""

from __future__ import annotations

import pytest
import torch

from frontend.llm import LLM
from kernels.cpu_binding import available as c_kernels_available
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model_with_tokenizer
from tests.worker.runner_utils import hf_causal_lm, hf_greedy
from tests.worker.test_gpt_oss import GPT_OSS
from tests.worker.test_gpt_oss import _perturb as perturb_gpt_oss

NEW_TOKENS = 10
WINDOW = 8
SHARED = 40  # two full blocks of 16 cached, five windows long
SUFFIXES = (3, 9, 20)
HEAD64 = {"hidden_size": 256, "num_attention_heads": 4}

# name -> (family, overrides, the backend expected to run it, config that removes the windows)
CASES = {
    "mistral-c": ("mistral", {"sliding_window": WINDOW, **HEAD64}, "cpu", {"sliding_window": None}),
    "mistral-torch": ("mistral", {"sliding_window": WINDOW}, "torch", {"sliding_window": None}),
    "gpt_oss": (
        "gpt_oss",
        {**GPT_OSS, "sliding_window": WINDOW},
        "torch",
        {"layer_types": ["full_attention"] * GPT_OSS["num_hidden_layers"]},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefix_longer_than_the_window_hits_and_equals_transformers(tmp_path, name):
    family, overrides, backend, no_window = CASES[name]
    if backend == "cpu" and not c_kernels_available():
        pytest.skip("no C compiler on this machine")
    model_dir = make_tiny_model_with_tokenizer(tmp_path, arch=family, **overrides)
    if family == "gpt_oss":
        perturb_gpt_oss(model_dir)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 49152, (SHARED,), generator=gen).tolist()
    prompts = {
        f"shared+{n}": shared + torch.randint(3, 49152, (n,), generator=gen).tolist()
        for n in SUFFIXES
    }
    model = hf_causal_lm(model_dir)
    reference, _ = hf_greedy(model, prompts, NEW_TOKENS)
    # The window matters: without it transformers computes other logits for the longest prompt.
    longest = torch.tensor([prompts[f"shared+{SUFFIXES[-1]}"]])
    with torch.inference_mode():
        windowed = model(longest).logits
        full = hf_causal_lm(model_dir, **no_window)(longest).logits
    assert (windowed - full).abs().max() > 1e-3

    llm = LLM(
        str(model_dir),
        engine_process=False,
        device="cpu",
        max_model_len=128,
        kv_cache_memory="8MiB",
        enable_prefix_caching=True,
    )
    assert llm.engine_core.executor.worker.runner.backend.name == backend
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    first = next(iter(prompts.values()))
    llm.generate(prompt_token_ids=first, sampling_params=greedy, use_tqdm=False)  # fills the cache
    hits_before = llm.get_engine_stats()["prefix_cache_hits"]
    outputs = llm.generate(
        prompt_token_ids=list(prompts.values()), sampling_params=greedy, use_tqdm=False
    )
    # Every request found the shared prefix's two full blocks (the first its whole prompt's).
    assert llm.get_engine_stats()["prefix_cache_hits"] - hits_before >= len(prompts) * 32
    got = {r: list(out.outputs[0].token_ids) for r, out in zip(prompts, outputs, strict=True)}
    assert got == reference
