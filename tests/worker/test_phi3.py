"""Phi3ForCausalLM (gpu_worker/models/phi3.py) against transformers in fp32 on the CPU: a plain
Phi-3 with a sliding window shorter than the prompts, and a Phi-4-mini-shaped one (LongRoPE,
partial_rotary_factor 0.75, tied embeddings). Weights are drawn with initializer_range 0.3 so
that the rotation decides the greedy tokens (at transformers' 0.02 a tiny model's attention is
nearly uniform and wrong frequencies could pass).

LongRoPE's factor set is chosen per request (the engine core's rope_long, sent with the request):
here the runner is driven directly, so the prompts beyond the original context (32) are sent
long; tests/worker/test_longrope_per_request.py checks the engine core's choice, a short and a
long request in one batch and a request crossing the original context during decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from config.errors import ConfigError
from engine_core.resolve import resolved_config
from protocol.sampling_params import SamplingParams
from tests.worker.runner_utils import (
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
    run_multiproc,
)

NEW_TOKENS = 16
ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE model
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    initializer_range=0.3,
)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def _longrope(rotary_dim: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": (1 + torch.rand(rotary_dim // 2, generator=gen)).tolist(),
        "long_factor": (2 + 6 * torch.rand(rotary_dim // 2, generator=gen)).tolist(),
    }


CASES = {
    "phi3-window": dict(max_position_embeddings=256, sliding_window=12),
    "phi4-mini-longrope": dict(
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75,
        rope_parameters=_longrope(12),
        tie_word_embeddings=True,
    ),
}


def _make_phi3(path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY, **overrides))
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_dir = _make_phi3(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    return request.param, model_dir, runner, driver


def test_loads_as_configured(case):
    name, _, runner, _ = case
    assert runner.model is not None and type(runner.model).__name__ == "Phi3ForCausalLM"
    rotary = runner.model.rotary
    layers = runner.model.model.layers
    if name == "phi3-window":
        assert rotary.rotary_dim == 16 and runner.arch.rope_scaling is None
        assert [ly.self_attn.attn.sliding_window for ly in layers] == [12, 12]
    else:
        assert rotary.rotary_dim == 12 and rotary.head_dim == 16
        assert runner.arch.rope_scaling is not None
        assert runner.arch.rope_scaling["rope_type"] == "longrope"
        assert runner.arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        # Both factor sets: short rows 0..127, long rows 128..255.
        assert rotary.long_offset == 128 and rotary.cos.shape == (256, 12)
        assert runner.model.fused_decode.stack() is None  # the fused C step refuses partial


def test_split_projections_equal_the_checkpoint(case):
    """rewrite_weights splits qkv_proj into q/k/v and gate_up_proj into gate/up (the names the
    loader's stacked shards take, so tensor parallelism cuts each by heads and columns): the
    pieces are the checkpoint's rows, q then k then v, gate then up."""
    from safetensors.torch import load_file

    _, model_dir, runner, _ = case
    tensors = load_file(str(model_dir / "model.safetensors"))
    stream = [("model.safetensors", n, t) for n, t in tensors.items()]
    out = {name: t for _, name, t in runner.model.rewrite_weights(stream)}
    assert not any(n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in out)
    prefix = "model.layers.1."
    q, k, v = (out[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv")
    assert (q.shape[0], k.shape[0], v.shape[0]) == (64, 32, 32)
    torch.testing.assert_close(
        torch.cat([q, k, v]), tensors[f"{prefix}self_attn.qkv_proj.weight"], rtol=0, atol=0
    )
    gate, up = out[f"{prefix}mlp.gate_proj.weight"], out[f"{prefix}mlp.up_proj.weight"]
    assert gate.shape == up.shape == (128, 64)
    torch.testing.assert_close(
        torch.cat([gate, up]), tensors[f"{prefix}mlp.gate_up_proj.weight"], rtol=0, atol=0
    )


def test_greedy_tokens_equal_transformers(case):
    """Prompts longer than the window (phi3-window); for LongRoPE served past its original
    context, prompts beyond it (transformers turns them with the long factors throughout)."""
    name, model_dir, _, driver = case
    lengths = (40, 50) if name == "phi4-mini-longrope" else (20, 30)
    prompts = random_prompts(512, lengths)
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    long = name == "phi4-mini-longrope"
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, rope_long=long), reference)
    outputs = {}
    for req_id, ids in prompts.items():  # one at a time, and in prompt chunks
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS, chunk=7, rope_long=long))
    assert_same_tokens(outputs, reference)


def test_longrope_within_the_original_context_uses_the_short_factors(tmp_path):
    """max_model_len within the original context (32): no request can turn long (the engine
    core's threshold is None); the short factors are transformers' for every sequence that
    fits; the same requests sent long answer differently (the factors decide the tokens)."""
    from config.rope_arch import long_rope_threshold

    model_dir = _make_phi3(tmp_path / "m", **CASES["phi4-mini-longrope"])
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB", max_model_len=ORIGINAL)
    assert runner.arch.rope_scaling is not None
    assert long_rope_threshold(runner.arch.rope_scaling, ORIGINAL) is None
    prompts = random_prompts(512, (8, 14))
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=5), reference)
    assert driver.run(prompts, GREEDY, NEW_TOKENS, rope_long=True) != reference


def test_tensor_parallel_shards_the_split_projections(case):
    """Two ranks (gloo, multiprocess executor): each takes its q/k/v heads and gate/up columns
    of the split fused tensors; the tokens equal transformers'."""
    name, model_dir, _, _ = case
    prompts = random_prompts(512, (40 if name == "phi4-mini-longrope" else 22,), seed=3)
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    outputs, _ = run_multiproc(
        model_dir,
        prompts,
        GREEDY,
        NEW_TOKENS,
        tensor_parallel_size=2,
        rope_long=name == "phi4-mini-longrope",
    )
    assert_same_tokens(outputs, reference)


def test_config_refusals(tmp_path):
    bad_factor = dict(CASES["phi4-mini-longrope"])
    model_dir = _make_phi3(tmp_path / "m", **bad_factor)
    import json

    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["long_factor"][:-1]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="long_factor has 5 entries; 12 rotary dims need 6"):
        resolved_config(model=str(model_dir), device="cpu")
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["short_factor"]
    cfg["hidden_act"] = "gelu"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        resolved_config(model=str(model_dir), device="cpu")
