"""A GGUF model's quantized weights against the same file dequantized at load, through the model
runner: on the CPU (the C kernels), on the CPU through the Triton kernels' path (weights packed
for the device, the kernels under TRITON_INTERPRET=1: the loader, the layers and the kernels
together, as CUDA runs them), and on CUDA (skipped without a GPU).

The model is tests/worker/test_gguf_quant.py's tiny llama of mixed types (Q4_K q and k beside
Q6_K v, Q5_K, Q8_0, Q5_1, an F16 gate that keeps gate_up dense, a Q5_0 embedding, an untied Q6_K
output projection), resolved as a .gguf model: its cache directory is written beforehand with
the file's weights dequantized, which is what conversion would write.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from config.default_model import gguf_cache_dir
from config.gguf_convert import GGUF_LINK, dense_tensor, hf_tensor_name
from config.gguf_tensors import read_gguf_tensors
from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.quant_linear import GGUFLinearMethod, GGUFTritonLinearMethod
from gpu_worker.loader import gguf_weights
from kernels.gguf_device import DeviceQuantWeight
from kernels.int_device import DeviceIntWeight
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import (
    assert_first_logprobs_close,
    count_logits_calls,
    make_runner,
)
from tests.worker.test_gguf_quant import write_gguf

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA test tier: no GPU here")

PROMPTS = {"a": list(range(3, 40)), "b": [7], "c": list(range(100, 121))}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """The mixed-type .gguf path, with ENGINE_CACHE_DIR pointing at its prepared cache."""
    root = tmp_path_factory.mktemp("gguf_cuda")
    previous = os.environ.get("ENGINE_CACHE_DIR")
    os.environ["ENGINE_CACHE_DIR"] = str(root / "cache")
    try:
        gguf_file = write_gguf(root / "tiny.gguf", layers=2)
        model_dir = make_tiny_model(
            gguf_cache_dir(gguf_file),
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        config = json.loads((model_dir / "config.json").read_text())
        assert config["num_hidden_layers"] == 2 and not config["tie_word_embeddings"]
        dense = {
            hf_tensor_name(t.name): dense_tensor(t, hf_tensor_name(t.name), 4, 2).contiguous()
            for t in read_gguf_tensors(gguf_file)
        }
        save_file(dense, str(model_dir / "model.safetensors"))
        (model_dir / GGUF_LINK).symlink_to(gguf_file)
        yield str(gguf_file)
    finally:
        if previous is None:
            os.environ.pop("ENGINE_CACHE_DIR", None)
        else:
            os.environ["ENGINE_CACHE_DIR"] = previous


def _runner(model: str, device: str = "cuda", **kwargs):
    return make_runner(model, device=device, max_model_len=128, **kwargs)


@pytest.mark.parametrize(
    "device, enforce_eager, triton",
    [
        ("cpu", True, False),
        pytest.param("cpu", True, True, id="cpu-triton-interpreter"),
        pytest.param("cuda", True, True, marks=cuda),
        pytest.param("cuda", False, True, marks=cuda),
    ],
)
def test_fp32_quantized_equals_the_dequantized_model(
    gguf_model, device, enforce_eager, triton, monkeypatch
):
    if device == "cpu" and triton:
        assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it
        monkeypatch.setattr(gguf_weights, "uses_c_kernels", lambda model: False)
    runner, quantized = _runner(
        gguf_model, device, dtype="float32", quantization="gguf", enforce_eager=enforce_eager
    )
    monkeypatch.undo()  # the dense model below loads as usual
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    kept = [m for m in linears if isinstance(m.method, (GGUFLinearMethod, IntTritonLinearMethod))]
    assert len(kept) == len(linears) - 2  # the two gate_up projections hold an F16 part
    parts = [p for m in kept for p in m.method.parts]
    assert all(isinstance(p, (DeviceQuantWeight, DeviceIntWeight)) == triton for p in parts)
    assert all(p[1].device.type == device for p in parts if triton)
    assert isinstance(runner.model.model.embed_tokens.method, GGUFTritonLinearMethod) == triton
    dense_runner, dense = _runner(gguf_model, device, dtype="float32")
    assert not any(
        isinstance(m, Linear) and isinstance(m.method, GGUFLinearMethod)
        for m in dense_runner.model.modules()
    )
    # Decode batches of 3, 2 and 1 (graphs padded), and prefill chunks of 9 tokens; under the
    # interpreter (about 1 ms a program) two prompts and 4 tokens: chunks of 9 and 3 rows, then
    # decode rows of 2 and 1.
    prompts, new = PROMPTS, 8
    if device == "cpu" and triton:
        prompts, new = {"b": PROMPTS["b"], "c": PROMPTS["c"]}, 4
    assert quantized.run(prompts, GREEDY, new, chunk=9) == dense.run(prompts, GREEDY, new, chunk=9)


@cuda
def test_bf16_quantized_logprobs_within_tolerance_of_fp32(gguf_model):
    _, fp32 = _runner(gguf_model, dtype="float32")
    runner, bf16 = _runner(gguf_model, quantization="gguf")
    assert isinstance(runner.model.lm_head.method, GGUFLinearMethod)
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    assert_first_logprobs_close(bf16, fp32, PROMPTS)


def test_quantized_greedy_takes_the_argmax_in_the_output_projection(gguf_model, monkeypatch):
    """On the CPU a quantized output projection of one type fuses greedy's argmax for up to
    quant_few_rows() rows: the tokens of the path through the logits, and no logits built."""
    from kernels import quant_linear

    outputs = {}
    for fused in (True, False):
        runner, driver = _runner(gguf_model, "cpu", quantization="gguf")
        runner.fused_greedy = fused
        calls = count_logits_calls(runner, monkeypatch)
        one = driver.run({"a": PROMPTS["a"]}, GREEDY, 8, chunk=64)
        logits_calls_for_one = calls[0]
        many = {f"r{i}": PROMPTS["c"][i:] for i in range(quant_linear.quant_few_rows() + 1)}
        outputs[fused] = (one, driver.run(many, GREEDY, 8, chunk=64))
        if fused:
            assert logits_calls_for_one == 0  # one row per step: every step fused
            assert calls[0] > 0  # more rows than the kernel takes: through the logits
    assert outputs[True] == outputs[False]
