"""A Phi-3-mini-shaped model (head_dim 96: hidden over heads, as 3072 / 32) through the Triton
attention backend inside the real model runner, under the interpreter on the CPU: greedy tokens
equal transformers' in fp32, with a sliding window shorter than the prompts (Phi-3-mini-4k has
one), batched and in prompt chunks. The kernels pad the head dimension to 128 lanes."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from gpu_worker.attention import triton_backend
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from protocol.sampling_params import SamplingParams
from tests.worker.runner_utils import (
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
)

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def _make_phi3_head96(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        hidden_size=192,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=256,
        sliding_window=12,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        # Sharp attention: the rotation and the window decide the tokens (see test_phi3.py).
        initializer_range=0.3,
    )
    model = transformers.Phi3ForCausalLM(config)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def test_head_96_on_the_triton_backend_equals_transformers(tmp_path, monkeypatch):
    # Every step's attention (prefill, chunks and decodes) goes through the one-pass kernel:
    # counted, so a path around it (the CPU's fused decode step) would fail the test.
    head_dims: list[int] = []
    kernel = triton_backend.paged_attention
    monkeypatch.setattr(
        triton_backend,
        "paged_attention",
        lambda query, *a, **kw: head_dims.append(query.shape[-1]) or kernel(query, *a, **kw),
    )
    model_dir = _make_phi3_head96(tmp_path / "phi3")
    runner, driver = make_runner(
        model_dir, kv_cache_memory="4MiB", attention_backend=TritonAttentionBackend()
    )
    assert runner.backend.name == "triton" and runner.arch.head_dim == 96
    prompts = random_prompts(512, (20, 15))
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=7), reference)
    # 2 layers x (1 batched prefill + 7 decode steps, then 3 chunk steps + 7 decodes) at least.
    assert len(head_dims) >= 2 * (8 + 10) and set(head_dims) == {96}
