"""YaRN rotary embeddings (gpu_worker/layers/rotary.py) against transformers' own: the tables'
cos and sin (frequencies blended over the correction range, scaled by the attention factor),
q and k rotated by them, and the in-place kernels (the CPU's C kernel, the Triton kernel under
the interpreter) taking the scaled tables unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from config.model_arch import ModelArchConfig
from gpu_worker.layers.rotary import RotaryEmbedding, yarn_attention_factor
from kernels import cpu_binding
from kernels.triton import rotary
from tests.kernels.paged_inputs import DEVICE

HEAD_DIM, THETA, MAX_POS = 64, 150000.0, 4096

# gpt-oss's own (factor 32, truncate false), transformers' defaults (truncate absent: true),
# other factors and betas, an explicit attention factor, DeepSeek-V3's mscale pair, and no
# factor at all (the context ratio).
YARN_CASES = [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=True),
    dict(factor=4.0),
    dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, truncate=False),
    dict(factor=2.0, attention_factor=1.3),
    dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707),
    dict(factor=None, original_max_position_embeddings=512),
]


def _yarn(case: dict) -> dict:
    return {"rope_type": "yarn", "original_max_position_embeddings": 1024, **case}


def _hf_cos_sin(params: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin [T, head_dim] for a Llama config with these rope parameters."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": THETA, **params},
    )
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf(x, positions[None])
    return cos[0], sin[0]


def _ours(params: dict) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, params)


@pytest.mark.parametrize(
    "case", YARN_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_yarn_tables_equal_transformers(case):
    params = _yarn(case)
    positions = torch.tensor([0, 1, 7, 100, 1023, 2048, MAX_POS - 1])
    hf_cos, hf_sin = _hf_cos_sin(params, positions)
    rope = _ours(params)
    cos, sin = rope.cos[positions], rope.sin[positions].clone()
    sin[:, : HEAD_DIM // 2] *= -1  # our table folds rotate-half's sign into sin's first half
    # transformers computes the angles in fp32 (position * inv_freq rounded to ~2**-24 of the
    # angle), ours in fp64: at position 4095 the angles differ by up to ~4095 * 2**-24.
    tol = MAX_POS * 2.0**-23
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=tol)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=tol)
    # The scale is transformers' attention factor (cos^2 + sin^2 = factor^2), not 1.
    magnitude = (cos[:, 0] ** 2 + sin[:, 0] ** 2).sqrt()
    expected = hf_cos[:, 0].hypot(hf_sin[:, 0])
    torch.testing.assert_close(magnitude, expected, rtol=1e-6, atol=0)


def test_yarn_blends_frequencies_and_scales():
    """The case the comparison rests on is not a no-op: some frequencies are divided by the
    factor, some kept, the tables scaled by 0.1 ln(32) + 1."""
    params = _yarn(dict(factor=32.0, truncate=False))
    rope, plain = _ours(params), RotaryEmbedding(HEAD_DIM, MAX_POS, THETA)
    assert yarn_attention_factor(params) == pytest.approx(0.1 * math.log(32) + 1)
    # Position 1's angle is each dimension's frequency.
    scale = yarn_attention_factor(params)
    angle = torch.atan2(-rope.sin[1, : HEAD_DIM // 2], rope.cos[1, : HEAD_DIM // 2])
    base = torch.atan2(-plain.sin[1, : HEAD_DIM // 2], plain.cos[1, : HEAD_DIM // 2])
    ratio = angle / base
    assert ratio[0] == pytest.approx(1.0, abs=1e-6)  # the fastest frequency is kept
    assert ratio[-1] == pytest.approx(1 / 32, rel=1e-4)  # the slowest is interpolated
    assert ((ratio > 1 / 32 + 1e-3) & (ratio < 1 - 1e-3)).any()  # a ramp between
    assert rope.cos[0, 0] == pytest.approx(scale)


@pytest.mark.parametrize("case", YARN_CASES[:3], ids=["gpt-oss", "truncate", "factor4"])
def test_yarn_rotated_q_k_equal_transformers(case):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    params = _yarn(case)
    gen = torch.Generator().manual_seed(0)
    tokens, heads = 9, 3
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen)
    hf_cos, hf_sin = _hf_cos_sin(params, positions)
    # transformers: [batch, heads, T, head_dim]
    hf_q, _ = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos[None], hf_sin[None]
    )
    rope = _ours(params)
    cos, sin = rope.cos_sin(positions, torch.float32)
    ours = rope.apply(q, cos, sin)
    torch.testing.assert_close(ours, hf_q[0].transpose(0, 1), rtol=0, atol=MAX_POS * 2.0**-21)


def test_yarn_kernels_take_the_scaled_tables():
    """The in-place paths (C kernel for fp32 CPU tensors, Triton under the interpreter) rotate
    with the tables as given, scale included: equal to the torch formula."""
    params = _yarn(dict(factor=32.0, truncate=False))
    rope = _ours(params)
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads = 5, 3, 1
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM, generator=gen)
    qk = qkv[:, : (heads + kv_heads) * HEAD_DIM].view(tokens, heads + kv_heads, HEAD_DIM)
    expected = rope.apply(qk.clone(), cos, sin)
    # A table entry of 1 would have passed a kernel that ignored the scale; this one is not.
    assert float(cos[..., 0].hypot(sin[..., 0]).min()) > 1.3
    if cpu_binding.available():
        contiguous = qk.contiguous()
        rope.apply_(contiguous, cos, sin)
        torch.testing.assert_close(contiguous, expected, rtol=1e-5, atol=1e-5)
    # The Triton kernel: on the GPU where there is one, else under the interpreter.
    strided = qkv.clone().to(DEVICE)[:, : (heads + kv_heads) * HEAD_DIM]
    on_device = strided.view(tokens, heads + kv_heads, HEAD_DIM)
    rotary.rotary_(on_device, cos.to(DEVICE), sin.to(DEVICE))
    torch.testing.assert_close(on_device.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_yarn_config_accepted_and_partial_rotary_refused():
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 256,
        "vocab_size": 32,
        "rope_scaling": _yarn(dict(factor=4.0)),
    }
    arch = ModelArchConfig.from_dict(cfg)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RotaryEmbedding(HEAD_DIM, 64, THETA, _yarn(dict(factor=4.0, partial_rotary_factor=0.5)))
