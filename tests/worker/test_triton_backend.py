"""The Triton attention backend inside the real model runner (under the interpreter on CPU):
the same greedy tokens as the torch backend, for decodes, fresh prompts and chunked prefill."""

from __future__ import annotations

import pytest

from gpu_worker.attention.triton_backend import TritonAttentionBackend
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 16 is the smallest the kernel's tl.dot accepts; GQA ratio 2.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama",
        "llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_triton_backend_matches_torch_backend(model_dir):
    prompts = {"a": list(range(3, 40)), "b": [7], "c": list(range(100, 121))}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    _, torch_driver = make_runner(model_dir, max_model_len=128, block_size=16)
    expected = torch_driver.run(prompts, params, 6, chunk=9)

    runner, driver = make_runner(
        model_dir, max_model_len=128, block_size=16, attention_backend=TritonAttentionBackend()
    )
    assert runner.backend.name == "triton"
    assert driver.run(prompts, params, 6, chunk=9) == expected
