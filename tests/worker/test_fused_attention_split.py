"""The fused decode step's attention cuts each (row, KV head)'s context into parts attended by
different threads and merges them (kernels/cpu/decode_stack.c): with 3 KV heads on 2 threads,
2 parts each from 64 positions on; with 3 threads and 2 KV heads, 3 parts from 192 on. Long
contexts over many cache blocks, one and two rows, 2 and 3 threads: the same greedy tokens and
hidden states as the layer-by-layer path (paged_attention.c over whole contexts)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_binding
from kernels.decode_stack import DecodeStack
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")


def _recording(forward, seen):
    def record(*args):
        seen.append(forward(*args).clone())
        return seen[-1]

    return record


@pytest.fixture(scope="module", params=[3, 2], ids=["kv3", "kv2"])
def model_dir(request, tmp_path_factory):
    kv = request.param
    return make_tiny_model(
        tmp_path_factory.mktemp(f"split{kv}") / "tiny",
        hidden_size=64 * 2 * kv,
        intermediate_size=512,
        num_attention_heads=2 * kv,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
    )


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lengths", [(250,), (200, 61)], ids=["one-row", "two-rows"])
def test_split_attention_equals_the_layers(model_dir, threads, lengths):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    run = DecodeStack.run
    calls = []
    DecodeStack.run = lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a)
    try:
        runner, driver = make_runner(model_dir, max_model_len=512, dtype="float32")
        fused = runner.model.fused_decode
        results = []
        for enabled in (True, False):
            fused._enabled = enabled
            seen = []
            runner.model.forward = _recording(runner.model.forward, seen)
            prompts = {
                f"{enabled}-{i}": [(11 * i + 3 * j) % 250 + 1 for j in range(n)]
                for i, n in enumerate(lengths)
            }
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
            tokens = driver.run(prompts, params, 6)
            results.append((list(tokens.values()), seen))
            del runner.model.forward
    finally:
        DecodeStack.run = run
        torch.set_num_threads(before)
    (on_tokens, on_hidden), (off_tokens, off_hidden) = results
    assert calls == [len(lengths)] * 5  # every decode step fused when on
    assert on_tokens == off_tokens
    for a, b in zip(on_hidden, off_hidden):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3)


def test_per_part_timing_build(model_dir):
    """ENGINE_CPU_KERNEL_DEFINES=DECODE_STACK_PROFILE builds the kernels with the fused step's
    per-part timing (`python -m bench.single_stream --parts`); the usual build has none."""
    from kernels.decode_stack import PROFILE_PARTS, take_profile
    from tests.kernels.library_env import library_env

    assert take_profile() is None
    with library_env(ENGINE_CPU_KERNEL_DEFINES="DECODE_STACK_PROFILE"):
        runner, driver = make_runner(model_dir, max_model_len=512, dtype="float32")
        take_profile()
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
        driver.run({"a": list(range(1, 100))}, params, 4)
        threads = take_profile()
        assert threads is not None and list(threads[0]) == list(PROFILE_PARTS)
        for part in ("qkv", "attention", "o", "gate/up", "down"):
            assert threads[0][part] > 0
        assert all(v == 0 for v in take_profile()[0].values())  # taking clears
    assert take_profile() is None
