"""The fused decode step (kernels/cpu/decode_stack.c through gpu_worker/models/fused_decode.py)
computes what the layer-by-layer path computes: the same hidden states up to summation order and
the same greedy tokens, for quantized weights of several types and for fp32 blocked weights,
with several requests decoding at once; steps it does not take (prefill, mixed, too many rows)
go through the layers."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from config.gguf_convert import GGUF_LINK
from gpu_worker.loader.model_loader import load_model
from kernels import cpu_binding
from kernels.decode_stack import MAX_ROWS, DecodeStack
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner
from tests.worker.test_gguf_quant import write_gguf

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

# One type per fused projection (q, k and v alike), so each is one kernel run; several types
# across the model, the K-quants' 256-row records included.
_TYPES = {
    "attn_q": GGMLType.Q4_1,
    "attn_k": GGMLType.Q4_1,
    "attn_v": GGMLType.Q4_1,
    "attn_output": GGMLType.Q4_0,
    "ffn_gate": GGMLType.Q8_0,
    "ffn_up": GGMLType.Q8_0,
    "ffn_down": GGMLType.Q6_K,
    "output": GGMLType.Q5_K,
    "token_embd": GGMLType.Q4_K,
}
_TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    model_dir = make_tiny_model(root / "tiny", **_TINY)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    (model_dir / GGUF_LINK).symlink_to(write_gguf(root / "tiny.gguf", layers, _TYPES))
    return model_dir


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fused32") / "tiny", **_TINY)


def _recording(model):
    """Wrap model.forward to keep every step's hidden states."""
    seen, forward = [], model.forward

    def record(*args):
        out = forward(*args)
        seen.append(out.clone())
        return out

    model.forward = record
    return seen


def _runner(model_dir, quantized: bool):
    runner, driver = make_runner(model_dir, max_model_len=256, dtype="float32")
    if quantized:  # the same layers with the linked GGUF file's weights kept quantized
        runner.model = load_model(
            model_dir, runner.arch, torch.float32, torch.device("cpu"), "gguf"
        )
        runner.initialize_kv_cache(len(driver.free))
    return runner, driver


def _decode_both_ways(model_dir, rows: int, quantized: bool):
    """Greedy tokens and per-step hidden states with the fused step on, then off, on one runner."""
    runner, driver = _runner(model_dir, quantized)
    fused = runner.model.fused_decode
    calls = []
    run = DecodeStack.run
    DecodeStack.run = lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a)
    try:
        results = []
        for enabled in (True, False):
            fused._enabled = enabled
            seen = _recording(runner.model)
            prompts = {
                f"{enabled}-{i}": [(7 * i + j) % 200 + 1 for j in range(9 + 5 * i)]
                for i in range(rows)
            }
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
            tokens = driver.run(prompts, params, 8)
            results.append((list(tokens.values()), seen))
            del runner.model.forward
    finally:
        DecodeStack.run = run
    return results, calls


def _assert_same(results, calls, rows):
    (on_tokens, on_hidden), (off_tokens, off_hidden) = results
    assert on_tokens == off_tokens
    assert len(on_hidden) == len(off_hidden) == 8  # the prefill step, then 7 decode steps
    # Summation order differs in one place only (the first layer's norm: torch's against the C
    # row function; with that patched to the C one the two paths are bit-identical), and random
    # weights amplify an ulp there to ~1e-4 at some steps.
    for a, b in zip(on_hidden, off_hidden):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3)
    assert calls == [rows] * 7  # every decode step fused when on, none when off or at prefill


@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_decode_steps_equal_the_layers(quantized_dir, rows):
    results, calls = _decode_both_ways(quantized_dir, rows, quantized=True)
    _assert_same(results, calls, rows)


def test_fp32_decode_steps_equal_the_layers(fp32_dir):
    results, calls = _decode_both_ways(fp32_dir, 2, quantized=False)
    _assert_same(results, calls, 2)


def test_steps_the_kernel_does_not_take(fp32_dir):
    """More rows than MAX_ROWS, and a step mixing a prefill with decodes, run the layers."""
    runner, driver = _runner(fp32_dir, quantized=False)
    calls = []
    run = DecodeStack.run
    DecodeStack.run = lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a)
    try:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)
        driver.run({f"r{i}": [i + 1, i + 2] for i in range(MAX_ROWS + 1)}, params, 2)
        assert calls == []
        # Prompts in chunks of 2: steps of [2, 2] and [1, 2] tokens run the layers; [1, 1] (a's
        # decode beside b's last prompt token: one new token each) and [-, 1] are fused.
        driver.run({"a": [5, 6, 7], "b": [1, 2, 3, 4, 5]}, params, 2, chunk=2)
        assert calls == [2, 1]
    finally:
        DecodeStack.run = run
