"""A GGUF model of the 4- and 8-bit types the int kernel runs on CUDA (Q4_0, Q4_1, Q4_K, Q8_0
in every projection, the embedding and the output projection) against the same file dequantized
at load: the loader converts each projection to IntWeight parts and gives it
IntTritonLinearMethod (kernels/triton/int_matmul.py), the lookups included. On the CPU through
the device path (the kernels under TRITON_INTERPRET=1), and on CUDA (skipped without a GPU).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from safetensors.torch import save_file

from config.default_model import gguf_cache_dir
from config.gguf_convert import GGUF_LINK, dense_tensor, hf_tensor_name
from config.gguf_tensors import read_gguf_tensors
from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod
from gpu_worker.layers.linear import Linear
from gpu_worker.loader import gguf_weights
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner
from tests.worker.test_gguf_quant import write_gguf

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA test tier: no GPU here")

TYPES = {
    "attn_q": GGMLType.Q4_K,
    "attn_k": GGMLType.Q4_K,
    "attn_v": GGMLType.Q4_0,  # joins q and k's rows: one weight of 4-bit groups of 32
    "attn_output": GGMLType.Q4_1,
    "ffn_gate": GGMLType.Q8_0,
    "ffn_up": GGMLType.Q8_0,
    "ffn_down": GGMLType.Q4_K,
    "output": GGMLType.Q8_0,
    "token_embd": GGMLType.Q4_K,
}
PROMPTS = {"b": [7], "c": list(range(100, 121))}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)


@pytest.fixture(scope="module")
def int_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_int")
    previous = os.environ.get("ENGINE_CACHE_DIR")
    os.environ["ENGINE_CACHE_DIR"] = str(root / "cache")
    try:
        gguf_file = write_gguf(root / "tiny-int.gguf", layers=2, types=TYPES)
        model_dir = make_tiny_model(
            gguf_cache_dir(gguf_file),
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        assert not json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_int_types_run_the_int_kernel_and_equal_the_dequantized_model(
    int_gguf, device, monkeypatch
):
    if device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it
        monkeypatch.setattr(gguf_weights, "uses_c_kernels", lambda model: False)
    runner, quantized = make_runner(
        int_gguf, device=device, max_model_len=128, dtype="float32", quantization="gguf"
    )
    monkeypatch.undo()
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, IntTritonLinearMethod) for m in linears)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.method
    assert [(p.bits, p.out_features) for p in qkv.parts] == [(4, 512)]
    assert isinstance(runner.model.model.embed_tokens.method, IntTritonLinearMethod)
    _, dense = make_runner(int_gguf, device=device, max_model_len=128, dtype="float32")
    assert quantized.run(PROMPTS, GREEDY, 4, chunk=9) == dense.run(PROMPTS, GREEDY, 4, chunk=9)
