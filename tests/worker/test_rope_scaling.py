"""Each rope scaling type's tables (gpu_worker/layers/rope_scaling.py) against transformers'
own rotary embedding class, the partial rotary (Phi-4-mini's partial_rotary_factor) in the torch
path, the C kernel and the Triton kernel (under TRITON_INTERPRET=1 without a GPU), and the
configuration side (config/rope_arch.py: types read as transformers standardizes them, the
context the scaling extends max_model_len to)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from config.model_arch import SUPPORTED_ROPE_TYPES, ModelArchConfig
from config.rope_arch import long_rope_threshold, rope_context_len
from gpu_worker.layers.rotary import RotaryEmbedding, longrope_attention_factor
from kernels import cpu_binding
from tests.kernels.paged_inputs import DEVICE

HEAD_DIM, THETA, MAX_POS = 32, 10000.0, 64
# transformers computes the angles in fp32, ours in fp64: at position p they differ by up to
# ~p * 2**-24 (times the attention factor); positions here stay below 256.
TOL = 256 * 2.0**-22


def _hf_rotary(params: dict, *, partial: float = 1.0, max_pos: int = MAX_POS):
    """transformers' rotary embedding module for these rope parameters: Llama's for a full head,
    Phi-3's (which reads partial_rotary_factor) for a partial one."""
    common = dict(
        hidden_size=HEAD_DIM * 2,
        num_attention_heads=2,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": THETA, **params},
    )
    if partial != 1.0:
        common["rope_parameters"]["partial_rotary_factor"] = partial
        # Phi3Config's top-level original context wins over the one in rope_parameters.
        original = params.get("original_max_position_embeddings", max_pos)
        config = transformers.Phi3Config(**common, original_max_position_embeddings=original)
        return transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    config = transformers.LlamaConfig(head_dim=HEAD_DIM, **common)
    return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)


def _call(hf, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward call of transformers' module over these positions: cos, sin [T, dim]."""
    cos, sin = hf(torch.zeros(1), torch.tensor([positions]))
    return cos[0], sin[0]


def _ours(rope: RotaryEmbedding, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our table rows with rotate-half's sign (folded into sin's first half) taken out."""
    index = torch.tensor(positions)
    sin = rope.sin[index].clone()
    sin[:, : rope.half] *= -1
    return rope.cos[index], sin


def _assert_rows(rope: RotaryEmbedding, hf_cos_sin, positions: list[int]) -> None:
    cos, sin = _ours(rope, positions)
    torch.testing.assert_close(cos, hf_cos_sin[0], rtol=0, atol=TOL)
    torch.testing.assert_close(sin, hf_cos_sin[1], rtol=0, atol=TOL)


def _generation_calls(hf, prompt_len: int, end: int):
    """transformers as generate() calls it: the prompt in one call, then one position a call.
    Yields (positions, cos, sin) of each call."""
    first = list(range(prompt_len))
    yield first, *_call(hf, first)
    for p in range(prompt_len, end):
        yield [p], *_call(hf, [p])


# --- position-independent types: any call, any positions --------------------------------------

STATIC_CASES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "default-partial": dict(rope_type="default"),  # Phi-4-mini without its LongRoPE
}


@pytest.mark.parametrize("name", sorted(STATIC_CASES))
def test_static_types_equal_transformers(name):
    params = STATIC_CASES[name]
    partial = 0.75 if name.endswith("partial") else 1.0
    hf = _hf_rotary(dict(params), partial=partial)
    rotary_dim = int(HEAD_DIM * partial)
    scaling = None if params["rope_type"] == "default" else params
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, scaling, rotary_dim)
    assert rope.cos.shape[1] == rotary_dim
    positions = [0, 1, 5, 15, 16, 40, MAX_POS - 1]
    _assert_rows(rope, _call(hf, positions), positions)


# --- LongRoPE -----------------------------------------------------------------------------------


def _longrope(dim: int, **extra) -> dict:
    gen = torch.Generator().manual_seed(dim)
    short = (1 + torch.rand(dim // 2, generator=gen)).tolist()
    long = (1 + 8 * torch.rand(dim // 2, generator=gen)).tolist()
    return dict(
        rope_type="longrope",
        short_factor=short,
        long_factor=long,
        original_max_position_embeddings=16,
        **extra,
    )


LONGROPE_CASES = {
    # factor from max_position_embeddings / original (Phi-3's configs leave factor out)
    "ratio": (1.0, {}),
    "factor": (1.0, dict(factor=2.0)),
    "attention-factor": (1.0, dict(attention_factor=1.25)),
    "partial": (0.75, {}),  # Phi-4-mini's partial_rotary_factor
}


@pytest.mark.parametrize("name", sorted(LONGROPE_CASES))
def test_longrope_equals_transformers(name):
    """transformers chooses the factors per call (long once the call's last position reaches the
    original context). The engine's table holds both sets: rows 0..MAX_POS-1 (a short request's
    positions) equal every call of a generation that stays within the original context, rows
    long_offset + p (a long request's) a prompt beyond it in one call and every position
    generated after it."""
    partial, extra = LONGROPE_CASES[name]
    rotary_dim = int(HEAD_DIM * partial)
    params = {**_longrope(rotary_dim, **extra), "partial_rotary_factor": partial}
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, dict(params), rotary_dim)
    assert rope.long_offset == MAX_POS and rope.cos.shape == (2 * MAX_POS, rotary_dim)
    for positions, cos, sin in _generation_calls(_hf_rotary(dict(params), partial=partial), 10, 16):
        _assert_rows(rope, (cos, sin), positions)
    for positions, cos, sin in _generation_calls(_hf_rotary(dict(params), partial=partial), 24, 64):
        _assert_rows(rope, (cos, sin), [p + rope.long_offset for p in positions])
    # The attention factor is not 1 (it scales cos and sin), and the factor sets differ: the
    # comparisons would catch either left out.
    scale = longrope_attention_factor({**params, "max_position_embeddings": MAX_POS})
    assert scale == pytest.approx(_hf_rotary(dict(params), partial=partial).attention_scaling)
    assert scale > 1.05 and rope.cos[0, 0] == pytest.approx(scale)
    assert not torch.allclose(rope.cos[1:MAX_POS], rope.cos[MAX_POS + 1 :], atol=1e-3)


def test_longrope_threshold_follows_the_served_context():
    """config/rope_arch.py long_rope_threshold: the original context when max_model_len passes
    it (requests beyond it turn long), None within it (none can) and for other types."""
    params = _longrope(HEAD_DIM)
    assert long_rope_threshold(params, 16) is None
    assert long_rope_threshold(params, 17) == 16
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    assert long_rope_threshold(yarn, 1000) is None and long_rope_threshold(None, 10) is None


def test_longrope_factors_of_the_wrong_length_are_refused():
    params = _longrope(HEAD_DIM)
    params["long_factor"] = params["long_factor"][:-1]
    with pytest.raises(ValueError, match="long_factor has 15 entries"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, params)


# --- dynamic NTK --------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_dynamic_ntk_equals_transformers_over_a_generation(factor):
    """transformers recomputes the base from each call's length (once past
    max_position_embeddings); our row p holds the base for length max(p + 1, max_position_
    embeddings): every call of a generation from a prompt within the context, token by token
    far beyond it, is equal."""
    params = dict(rope_type="dynamic", factor=factor)
    hf = _hf_rotary(dict(params))
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, params)
    rows = rope.cos.shape[0]
    assert rows == int(MAX_POS * factor)  # the table covers the extended context
    for positions, cos, sin in _generation_calls(hf, prompt_len=30, end=rows):
        _assert_rows(rope, (cos, sin), positions)
    # Beyond the context the frequencies are not the default ones (the test is not vacuous).
    plain = RotaryEmbedding(HEAD_DIM, rows, THETA)
    assert not torch.allclose(rope.cos[rows - 1], plain.cos[rows - 1], atol=1e-3)
    torch.testing.assert_close(rope.cos[:MAX_POS], plain.cos[:MAX_POS])


# --- partial rotary in every path ---------------------------------------------------------------


def _partial_rope() -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, _longrope(24), rotary_dim=24)  # long


def test_partial_rotary_rotates_like_transformers_phi3():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rope = _partial_rope()
    gen = torch.Generator().manual_seed(0)
    tokens, heads = 7, 3
    positions = torch.tensor([0, 3, 15, 16, 17, 40, 63])
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen)
    cos, sin = _ours(rope, positions.tolist())
    hf_q, _ = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None]
    )
    ours = rope.apply(q, *rope.cos_sin(positions, torch.float32))
    torch.testing.assert_close(ours, hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[..., 24:], q[..., 24:], rtol=0, atol=0)  # passed through
    assert not rope.fuses_qk_norm(q)  # the fused q/k-norm kernel turns whole heads only


def _qk_case(rope: RotaryEmbedding):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads = 6, 3, 1
    positions = torch.tensor([0, 2, 15, 16, 33, 63])
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM, generator=gen)
    qk = qkv[:, : (heads + kv_heads) * HEAD_DIM].view(tokens, heads + kv_heads, HEAD_DIM)
    return qkv, qk, cos, sin, rope.apply(qk.clone(), cos, sin)


@pytest.mark.skipif(not cpu_binding.available(), reason="C kernels not built")
def test_partial_rotary_c_kernel_equals_torch():
    rope = _partial_rope()
    qkv, qk, cos, sin, expected = _qk_case(rope)
    packed = qk.contiguous()
    rope.apply_(packed, cos, sin)  # the C kernel: fp32 CPU, heads packed
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[..., 24:], qk[..., 24:], rtol=0, atol=0)
    from kernels.rotary import rotary_cpu_

    with pytest.raises(ValueError, match="do not match"):
        rotary_cpu_(qk.contiguous(), cos[..., :23].contiguous(), sin[..., :23].contiguous())


def test_partial_rotary_triton_kernel_equals_torch():
    from kernels.triton.rotary import rotary_

    rope = _partial_rope()
    qkv, qk, cos, sin, expected = _qk_case(rope)
    heads = qk.shape[1]
    strided = qkv.clone().to(DEVICE)[:, : heads * HEAD_DIM].view(-1, heads, HEAD_DIM)
    rotary_(strided, cos.to(DEVICE), sin.to(DEVICE))  # strided over tokens, like q/k in qkv
    torch.testing.assert_close(strided.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_partial_rotary_torch_fallback_in_place():
    rope = _partial_rope()
    qkv, qk, cos, sin, expected = _qk_case(rope)
    rope.apply_(qk, cos.double().float(), sin)  # strided x: not the C kernel's packed layout
    torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)


# --- configuration ------------------------------------------------------------------------------


def _arch(**fields) -> ModelArchConfig:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "vocab_size": 32,
        "max_position_embeddings": 4096,
        **fields,
    }
    return ModelArchConfig.from_dict(cfg)


def test_types_are_supported_and_read_as_transformers_standardizes_them():
    assert {"dynamic", "longrope", "yarn"} <= set(SUPPORTED_ROPE_TYPES)
    # Qwen2.5's / Qwen3's YaRN as their config.json has it (pre-v5 layout, "type" key).
    arch = _arch(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        max_position_embeddings=32768,
    )
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    assert arch.max_context_len == 131072 and arch.max_position_embeddings == 32768
    # Phi-3: "su" is LongRoPE, the original context at the top level wins (Phi3Config).
    su = {"type": "su", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
    phi = _arch(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        rope_scaling=su,
        original_max_position_embeddings=2048,
        max_position_embeddings=131072,
        partial_rotary_factor=0.5,
    )
    assert phi.rope_scaling is not None
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 2048
    assert phi.rotary_dim == 16 and phi.max_context_len == 131072
    dyn = _arch(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert dyn.max_context_len == 8192
    assert _arch().max_context_len == 4096 and _arch().rotary_dim == 32


def test_rope_context_len_rules():
    assert rope_context_len(100, None) == 100
    assert rope_context_len(100, {"rope_type": "linear", "factor": 2.5}) == 250
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert rope_context_len(131072, llama3) == 131072
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert rope_context_len(40960, yarn) == 131072
    assert rope_context_len(40960, {**yarn, "factor": None}) == 40960


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "dynamic"}, "rope scaling 'dynamic' needs factor"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "needs long_factor"),
        ({"rope_type": "mrope", "factor": 2.0}, "rope scaling type 'mrope' is not supported"),
    ],
)
def test_bad_scaling_refused_naming_the_field(scaling, match):
    with pytest.raises(ValueError, match=match):
        _arch(rope_scaling=scaling)


def test_partial_rotary_factor_that_does_not_fit_a_head_is_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor 0.01"):
        _ = _arch(partial_rotary_factor=0.01).rotary_dim
    with pytest.raises(ValueError, match="does not give the 32 rotary dims"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, {**_longrope(24), "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="rotary_dim 7 must be even"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, rotary_dim=7)
    narrow = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, rotary_dim=8)
    # Position 1's angle in dim 0 is 1 radian; dim 1's frequency is THETA ** (-2 / 8).
    assert narrow.cos.shape == (MAX_POS, 8)
    assert math.isclose(narrow.cos[1, 0], math.cos(1.0), rel_tol=1e-6)
    assert math.isclose(narrow.cos[1, 1], math.cos(THETA ** (-2 / 8)), rel_tol=1e-6)
