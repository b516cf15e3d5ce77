"""A tiny Llama with --quantization fp8 on the W8A8 path (Fp8LinearMethod with w8a8, torch's CPU
_scaled_mm, the Triton kernels under TRITON_INTERPRET=1; on CUDA where there is a GPU with FP8
tensor cores): each DecoderLayer quantizes the activations of qkv_proj and gate_up_proj in the
norm before them (kernels/triton/rms_norm_quant.py, an Fp8Activation into the projection), and
gives the tokens and first-step logprobs of the unfused W8A8 path (the norm, then the
projection's own quantizer)."""

from __future__ import annotations

import os
from typing import cast

import pytest
import torch

from gpu_worker.layers.fp8_linear import Fp8Activation, Fp8LinearMethod, fp8_w8a8_supported
from gpu_worker.loader import quant_methods
from gpu_worker.models.blocks import DecoderLayer, DecoderModel, GatedMLP
from kernels.quant_weights import Fp8Weight
from protocol.sampling_params import SamplingParams
from tests.worker import test_quantized_checkpoints as base
from tests.worker.runner_utils import make_runner
from tests.worker.test_quantized_checkpoints import NEW_TOKENS, PROMPTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
dense_dir = base.dense_dir  # the module's fixture: the tiny dense Llama


def _run(dense_dir, tmp_path, monkeypatch, fused: bool):
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it
    elif not fp8_w8a8_supported(torch.device(DEVICE)):
        pytest.skip("compute capability below 8.9: no FP8 tensor cores")
    methods: list[Fp8LinearMethod] = []
    fused_calls: list[int] = []

    def fp8_method(parts, device, w8a8=True, dtype=None):
        # The CUDA method on this device (on the CPU the loader would dequantize W instead).
        on = [Fp8Weight(p.weight.to(device), p.scale.to(device), p.input_scale) for p in parts]
        methods.append(Fp8LinearMethod(on, w8a8=True, dtype=dtype))
        assert methods[-1].w8a8
        return methods[-1]

    real = Fp8LinearMethod.norm_and_quantize

    def counted(self, norm, x, residual):
        fused_calls.append(x.shape[0])
        out = real(self, norm, x, residual)
        assert isinstance(out[0], Fp8Activation)
        return out

    monkeypatch.setattr(quant_methods, "fp8_method", fp8_method)
    monkeypatch.setattr(Fp8LinearMethod, "norm_and_quantize", counted)
    if not fused:
        monkeypatch.setattr(DecoderLayer, "fp8_inputs", lambda self: (None, None))
    runner, driver = make_runner(dense_dir, device=DEVICE, max_model_len=64, quantization="fp8")
    assert len(methods) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert runner.model is not None
    body = cast(DecoderModel, runner.model.model)
    layers = [cast(DecoderLayer, layer) for layer in body.layers]
    if fused:
        found = [m for layer in layers for m in layer.fp8_inputs()]
        expected = [
            (layer.self_attn.qkv_proj.method, cast(GatedMLP, layer.mlp).gate_up_proj.method)
            for layer in layers
        ]
        assert found == [m for pair in expected for m in pair]
    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=3)
    tokens = driver.run(PROMPTS, params, NEW_TOKENS)
    monkeypatch.undo()
    return tokens, driver.logprobs, fused_calls


def test_fused_norm_quantization_gives_the_unfused_w8a8_tokens(dense_dir, tmp_path, monkeypatch):
    fused, fused_logprobs, calls = _run(dense_dir, tmp_path, monkeypatch, fused=True)
    # two norms in each of 2 layers at every step: the fused kernel ran, and only there
    assert calls and len(calls) % 4 == 0
    unfused, unfused_logprobs, none = _run(dense_dir, tmp_path, monkeypatch, fused=False)
    assert not none
    assert fused == unfused
    for req in PROMPTS:
        for got, expected in zip(fused_logprobs[req], unfused_logprobs[req], strict=True):
            assert got.token_ids == expected.token_ids, req
            # The unfused norm on the CPU is the C kernel (the fused one Triton's): a last-bit
            # difference in a normed value may move an fp8 code by one step (here: none, 0.0).
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(expected.logprobs), rtol=0, atol=2e-2
            )
