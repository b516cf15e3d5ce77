"""gpt-oss through the model runner equals transformers on tiny random models (fp32, CPU):
attention sinks, sliding-window layers alternating with full ones (prompts longer than the
window, prefilled whole and in chunks), YaRN, the clamped SwiGLU experts with biases, and the
MXFP4 experts of the official checkpoints (packed here from the format's definition, checked
against transformers' dequantizer, loaded and run against transformers on the dequantized
weights). Also the refusals: a quantized checkpoint of another format, MXFP4 blocks without
their scales, a swiglu_alpha the kernel does not compute.

The tiny models get the constants transformers initialises (biases 0, norm weights 1) random
values, embeddings at unit scale (at 0.02 the biases would drown every token's own signal),
sinks of unit scale (so they take a real share of each softmax), routers 20x larger (else every
token's router logits are nearly equal) and experts 10x larger (so the swiglu_limit clamp is
reached).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.loader.mxfp4 import dequantize_mxfp4
from gpu_worker.models.gpt_oss import GptOssMoeBlock
from gpu_worker.models.moe_block import Router
from gpu_worker.models.weights import WeightLoadError
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

NEW_TOKENS = 12
WINDOW = 8
PROMPT_LENS = (1, 7, 20, 37)  # within the window, and two and four times past it
LOGIT_ATOL = 1e-4
YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=8.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=64,
)
GPT_OSS = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=64,
    num_hidden_layers=3,
    sliding_window=WINDOW,
    head_dim=16,
    rope_parameters=YARN,
)
# The official layout: the prompt modules stay dense, the experts are MXFP4.
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


# -- MXFP4 packing, from the format's definition ---------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8
    [..., K/32]): each block of 32 values shares the power of two 2**e (e the least that
    brings its largest magnitude within e2m1's 6), stored as e + 127; each value becomes the
    nearest e2m1 code (sign bit 3, magnitude index bits 0-2), two a byte, the first in the low
    nibble."""
    *lead, k = w.shape
    block = w.reshape(*lead, k // 32, 32)
    amax = block.abs().amax(-1)
    e = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = block / torch.exp2(e)[..., None]
    magnitude = (scaled.abs()[..., None] - _E2M1).abs().argmin(-1)
    code = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    pairs = code.reshape(*lead, k // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (e + 127).to(torch.uint8)


def _to_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """dst: src's checkpoint with every expert projection in MXFP4 as the official checkpoints
    store it (rows = outputs: gate_up [E, 2I, H/32, 16], down [E, H, I/32, 16]); returns src's
    tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(
                t.transpose(1, 2).contiguous()
            )
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = MXFP4_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return tensors


def test_mxfp4_packing_follows_the_format_and_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # One block by hand: 1.5 (code 3) then -6 (code 15) in the first byte, low nibble first;
    # scale 2**1 (stored 128): 3.0, -12.0, then zeros.
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 3 | (15 << 4)
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)
    expected = torch.zeros(32)
    expected[:2] = torch.tensor([3.0, -12.0])
    assert torch.equal(dequantize_mxfp4(blocks, scales)[0, 0], expected)

    gen = torch.Generator().manual_seed(3)
    # Blocks of very different magnitudes, so the scales differ.
    w = torch.randn(3, 8, 96, generator=gen) * torch.logspace(-3, 2, 24).reshape(3, 8, 1)
    packed, scale = quantize_mxfp4(w)
    ours = dequantize_mxfp4(packed, scale)
    # transformers' dequantizer (the reference) returns [E, K, rows]: our rows transposed.
    theirs = convert_moe_packed_tensors(packed, scale, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))
    # The packing is a quantization of w: within half of e2m1's widest step (2, at 4..6) of
    # each block's scale, and exact for values e2m1 holds.
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
    assert ((ours - w).abs() <= step + 1e-12 * w.abs()).all()
    assert (ours - w).abs().max() > 0  # a lossy format: the comparison above is not vacuous
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(ours)), ours)


def test_mxfp4_bfloat16_is_exact():
    gen = torch.Generator().manual_seed(4)
    packed, scale = quantize_mxfp4(torch.randn(4, 64, generator=gen))
    fp32 = dequantize_mxfp4(packed, scale)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), fp32)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(packed, scale[:, :1])


# -- the model against transformers ------------------------------------------------------------


def _perturb(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("sinks"):
            tensors[name] = torch.randn(t.shape, generator=gen)
        elif name.endswith("_bias") or name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.5 * torch.randn(t.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            tensors[name] = 50.0 * t
        elif name.endswith("router.weight"):
            tensors[name] = 20.0 * t
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = 10.0 * t
    save_file(tensors, path, metadata={"format": "pt"})


def _hf_model(model_dir: Path, mxfp4: bool):
    from transformers import Mxfp4Config

    # On the CPU transformers dequantizes MXFP4 (dequantize=True says so without accelerate).
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    return hf_causal_lm(model_dir, **extra)


# name -> (overrides of GPT_OSS, MXFP4 experts)
CASES = {
    "gpt_oss": ({}, False),
    # Head size 64 as the released models; a tighter gate/up clamp.
    "gpt_oss-head64-limit3": ({"head_dim": 64, "swiglu_limit": 3.0}, False),
    "gpt_oss-mxfp4": ({}, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(runner, driver, prompts, HF greedy tokens, HF last logits, HF model, checkpoint dir)."""
    overrides, mxfp4 = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(root / "dense", "gpt_oss", **{**GPT_OSS, **overrides})
    _perturb(model_dir)
    if mxfp4:
        _to_mxfp4_checkpoint(model_dir, root / "mxfp4")
        model_dir = root / "mxfp4"
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    model = _hf_model(model_dir, mxfp4)
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    tokens, logits = hf_greedy(model, prompts, NEW_TOKENS)
    last = {r: x[-1] for r, x in logits.items()}
    return runner, driver, prompts, tokens, last, model, model_dir


def test_layers_as_the_config_says(case):
    runner, _, _, _, _, model, _ = case
    layers = runner.model.model.layers
    # layer_types alternates sliding and full, starting with sliding.
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW]
    for ours, theirs in zip(layers, model.model.layers, strict=True):
        assert isinstance(ours.mlp, GptOssMoeBlock) and isinstance(ours.mlp.experts, FusedMoE)
        # The router is moe_block's Router (F.linear with bias), which the CPU layout pass
        # leaves as the checkpoint has it, equal to transformers' router.
        assert type(ours.mlp.router) is Router
        assert torch.equal(ours.mlp.router.weight, theirs.mlp.router.weight.detach())
        assert torch.equal(ours.mlp.router.bias, theirs.mlp.router.bias.detach())
        assert torch.equal(ours.self_attn.attn.sinks, theirs.self_attn.sinks.detach())
    assert runner.arch.rope_scaling is not None and runner.arch.rope_scaling["rope_type"] == "yarn"


def test_experts_equal_transformers_weights(case):
    """Gate and up de-interleaved, projections transposed, MXFP4 dequantized: each expert's
    tensors equal the ones transformers computes with (its dequantized ones for MXFP4)."""
    runner, _, _, _, _, model, _ = case
    for ours, theirs in zip(runner.model.model.layers, model.model.layers, strict=True):
        experts, ref = ours.mlp.experts, theirs.mlp.experts
        gate_up = ref.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], interleaved rows
        stacked = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        w13, w2 = experts.stacked_experts()  # whichever layout the layer runs
        assert torch.equal(w13, stacked)
        assert torch.equal(w2, ref.down_proj.detach().transpose(1, 2))
        bias = ref.gate_up_proj_bias.detach()
        assert torch.equal(experts.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
        assert torch.equal(experts.w2_bias, ref.down_proj_bias.detach())


def test_all_requests_in_one_batch(case):
    _, driver, prompts, reference, _, _, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


@pytest.mark.parametrize("chunk", [5, 16])
def test_prompts_split_into_chunks(case, chunk):
    """Chunks shorter than the window and longer: the window spans chunk boundaries."""
    _, driver, prompts, reference, _, _, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=chunk), reference)


def test_last_position_logits_match_transformers(case, monkeypatch):
    runner, driver, prompts, _, ref_last, _, _ = case
    assert_last_logits_close(runner, driver, prompts, ref_last, LOGIT_ATOL, monkeypatch)


def test_engine_generate_mxfp4_equals_transformers(tmp_path, capsys):
    """`engine generate` on a tiny gpt-oss checkpoint in the official layout (MXFP4 experts,
    quantization_config mxfp4) with a real tokenizer and a prompt longer than the window
    prints transformers' text (transformers on the dequantized weights)."""
    from transformers import AutoTokenizer

    from serve.cli import main

    dense = make_tiny_model_with_tokenizer(tmp_path / "dense", arch="gpt_oss", **GPT_OSS)
    _perturb(dense)
    model_dir = tmp_path / "mxfp4"
    _to_mxfp4_checkpoint(dense, model_dir)
    prompt = "The experts of a mixture each read a few of the tokens, and the router decides which"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 2 * WINDOW
    model = _hf_model(model_dir, mxfp4=True)
    with torch.inference_mode():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    expected = prompt + tokenizer.decode(seq[0, len(ids) :], skip_special_tokens=True)
    argv = ["generate", prompt, "--model", str(model_dir), "--max-tokens", str(NEW_TOKENS)]
    rc = main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"])
    assert rc == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_greedy_tokens_at_tp2_and_expert_parallel_equal_one_rank(tmp_path):
    """Through the multiprocess executor at TP=2 (gloo): each rank's query heads' sinks, the
    attention biases, the experts' intermediate halves with their biases (the output bias
    once), and with --enable-expert-parallel two whole experts a rank, give one rank's greedy
    tokens."""
    model_dir = make_tiny_model(tmp_path, "gpt_oss", **GPT_OSS)
    _perturb(model_dir)
    prompts = {k: v for k, v in random_prompts(512, PROMPT_LENS).items() if k in ("len7", "len37")}
    _, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    expected = driver.run(prompts, GREEDY, NEW_TOKENS, chunk=16)
    for expert_parallel in (False, True):
        outputs, _ = run_multiproc(
            model_dir, prompts, GREEDY, NEW_TOKENS, chunk=16, enable_expert_parallel=expert_parallel
        )
        assert outputs == expected, expert_parallel


# The released gpt-oss-20b's config.json (the pre-v5 rope layout: rope_scaling, top-level
# rope_theta), weights aside.
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": MXFP4_CONFIG,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}


def test_released_config_resolves_as_transformers_reads_it(tmp_path):
    """The released 20b config.json is accepted when the configuration resolves (sinks,
    windows, YaRN, MXFP4), each layer's window and the MoE fields read as transformers reads
    them, and its YaRN tables equal transformers' rotary embedding for that config."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from config.moe_arch import GptOssMoeConfig
    from engine_core.resolve import resolved_config
    from gpu_worker.layers.rotary import RotaryEmbedding

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_20B))
    config = resolved_config(model=str(tmp_path), device="cpu", load_format="dummy")
    arch = config.arch
    assert arch is not None and config.max_model_len == 131072
    assert [arch.layer_sliding_window(i) for i in range(4)] == [128, None, 128, None]
    assert GptOssMoeConfig.from_hf(arch.hf_config) == GptOssMoeConfig(32, 4, 7.0, 2880)

    hf = GptOssRotaryEmbedding(GptOssConfig(**RELEASED_20B))
    positions = torch.tensor([0, 1, 127, 4095, 4096, 65536, 131071])
    hf_cos, hf_sin = hf(torch.zeros(1), positions[None])  # [1, T, head_dim / 2]
    ours = RotaryEmbedding(
        arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )
    half = arch.head_dim // 2
    # fp32 angles in transformers at position 131071: within 131072 * 2**-23 of fp64's.
    tol = 131072 * 2.0**-22
    torch.testing.assert_close(ours.cos[positions, :half], hf_cos[0], rtol=0, atol=tol)
    torch.testing.assert_close(-ours.sin[positions, :half], hf_sin[0], rtol=0, atol=tol)


# -- refusals ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("gpt_oss_small"), "gpt_oss", **{**GPT_OSS, "num_hidden_layers": 1}
    )


def _edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))


def test_other_checkpoint_quantizations_refused_at_configuration(dense_dir, tmp_path):
    from engine_core.resolve import resolved_config

    gptq = tmp_path / "gptq"
    shutil.copytree(dense_dir, gptq)
    _edit_config(gptq, quantization_config={"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes' is not supported"):
        resolved_config(model=str(gptq), device="cpu")
    llama = make_tiny_model(tmp_path / "llama", "llama")
    _edit_config(llama, quantization_config=MXFP4_CONFIG)
    with pytest.raises(ConfigError, match="read only for GptOssForCausalLM"):
        resolved_config(model=str(llama), device="cpu")


def test_mxfp4_blocks_without_scales_refused(dense_dir, tmp_path):
    quantized = tmp_path / "mxfp4"
    _to_mxfp4_checkpoint(dense_dir, quantized)
    path = quantized / "model.safetensors"
    tensors = load_file(path)
    down_scales = tensors.pop("model.layers.0.mlp.experts.down_proj_scales")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="down_proj_blocks has no .*down_proj_scales"):
        make_runner(quantized, kv_cache_memory="4MiB")
    # Scales of another shape (an expert short), or blocks that are not bytes.
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = down_scales[:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="down_proj_blocks .* and .*_scales .* do not pair"):
        make_runner(quantized, kv_cache_memory="4MiB")
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = blocks.to(torch.int16)
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = down_scales
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="gate_up_proj_blocks/_scales: .* must be uint8"):
        make_runner(quantized, kv_cache_memory="4MiB")


def test_other_swiglu_alpha_refused(dense_dir, tmp_path):
    other = tmp_path / "alpha"
    shutil.copytree(dense_dir, other)
    _edit_config(other, swiglu_alpha=1.5)
    with pytest.raises(ValueError, match="swiglu_alpha 1.5 is not supported"):
        make_runner(other, kv_cache_memory="4MiB")
