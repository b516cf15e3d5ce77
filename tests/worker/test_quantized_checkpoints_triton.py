"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints (tests/worker/test_quantized_checkpoints.py's
tiny Llama and its own quantizer) through the CUDA methods: IntTritonLinearMethod (the Triton int
GEMM, act-order perms included) and Fp8LinearMethod's weight-only path, on CUDA where there is a
GPU, else on the CPU with the kernels under TRITON_INTERPRET=1; greedy tokens equal transformers'
with the dequantized weights (fp32). The loader's choice of method by device is replaced by the
CUDA one here."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.layers.fp8_linear import Fp8LinearMethod
from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod
from gpu_worker.loader import quant_methods, quantized_checkpoint
from gpu_worker.loader.quant_methods import _to
from kernels.quant_weights import Fp8Weight
from protocol.sampling_params import SamplingParams
from tests.worker import test_quantized_checkpoints as base
from tests.worker.runner_utils import make_runner
from tests.worker.test_quantized_checkpoints import (
    NEW_TOKENS,
    PROMPTS,
    hf_greedy,
    hf_reference,
    write_checkpoint,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
dense_dir = base.dense_dir  # the module's fixture: the tiny dense Llama

CASES = [
    "gptq-asym-g32-desc-act",
    "gptq-8bit-channel-v2",
    "awq-g32",
    "ct-w4a16-g32-actorder-group",
    "ct-fp8-channel-dynamic",
    "ct-fp8-tensor-static",
]


@pytest.mark.parametrize("case", CASES)
def test_cuda_methods_give_the_dequantized_models_tokens(dense_dir, tmp_path, case, monkeypatch):
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it
    methods: list = []

    def int_method(parts, device):
        methods.append(IntTritonLinearMethod([_to(p, device) for p in parts]))
        return methods[-1]

    def fp8_method(parts, device, w8a8=True, dtype=None):
        # Weight-only: W dequantized to the activations' dtype (W8A8 rounds the activations to
        # fp8, so its tokens are not the dequantized model's; its math is tests/kernels/
        # test_fp8_linear.py's).
        on = [Fp8Weight(p.weight.to(device), p.scale.to(device), p.input_scale) for p in parts]
        methods.append(Fp8LinearMethod(on, w8a8=False, dtype=dtype))
        return methods[-1]

    for module in (quantized_checkpoint, quant_methods):
        monkeypatch.setattr(module, "int_method", int_method)
        monkeypatch.setattr(module, "fp8_method", fp8_method)
    deq = write_checkpoint(dense_dir, tmp_path / case, case)
    runner, driver = make_runner(tmp_path / case, device=DEVICE, max_model_len=64)
    # qkv, o, gate_up, down in each of 2 layers, less one the checkpoint leaves dense
    ignored = "re:.*layers\\.1\\.mlp\\.down_proj$" in base.CASES[case][1].get("ignore", [])
    assert len(methods) == 2 * 4 - ignored
    if "desc-act" in case or "actorder" in case:
        assert all(p.perm is not None for m in methods for p in m.parts)
    got = driver.run(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True), NEW_TOKENS)
    reference = hf_reference(dense_dir, deq)
    for req, ids in PROMPTS.items():
        assert got[req] == hf_greedy(reference, ids), (case, req)
