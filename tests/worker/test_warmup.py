"""Start-up warm-up leaves no kernel compile to the first requests.

Under the interpreter nothing compiles, so each Triton launch's arguments go through Triton's own
specialisation function (what its launcher keys the compile cache on): every key that requests
produce after warm-up must have been produced during warm-up.
"""

from __future__ import annotations

from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.warmup import warm_up_shapes
from kernels.triton import paged_attention as pa_module
from kernels.triton import paged_decode as pd_module
from kernels.triton import write_kv as kv_module
from protocol.sampling_params import SamplingParams
from tests.kernels.test_kernel_specialization import Launches, specialization_key
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner

KERNELS = (
    pa_module._paged_attention_kernel,
    kv_module._write_kv_kernel,
    pd_module._decode_partition_kernel,
    pd_module._decode_reduce_kernel,
)


def _keys(launches: Launches) -> set[tuple[str, str]]:
    by_name = {k.__name__: k for k in KERNELS}
    return {
        (name, repr(specialization_key(by_name[name], args, kwargs)))
        for name, calls in launches.calls.items()
        for args, kwargs in calls
    }


def test_warm_up_shapes_cover_chunks_decode_batches_and_long_contexts():
    groups = warm_up_shapes(max_num_seqs=32, budget=512, max_model_len=4096, long_context=2048)
    prefills = [lens[0] for lens, decodes in groups if len(lens) == 1 and decodes == 0]
    assert prefills == [1, 2, 4, 8, 16, 32, 64, 128, 512]
    assert [len(lens) for lens, decodes in groups if decodes][:-1] == [1, 2, 4, 8, 16, 24, 32]
    assert groups[-1] == ([2048], 1)
    short = warm_up_shapes(max_num_seqs=4, budget=2048, max_model_len=100, long_context=2048)
    assert all(max(lens) < 100 for lens, _ in short) and ([99], 0) in short


def test_requests_after_warm_up_compile_nothing_new(monkeypatch, tmp_path):
    path = make_tiny_model(
        tmp_path / "tiny", hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    runner, driver = make_runner(
        path,
        max_model_len=96,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=40,
        attention_backend=TritonAttentionBackend(),
    )
    launches = Launches(monkeypatch, *KERNELS)
    runner.warm_up()
    warmed = _keys(launches)
    assert {name for name, _ in warmed} >= {"_paged_attention_kernel", "_write_kv_kernel"}
    for calls in launches.calls.values():
        calls.clear()

    prompts = {"a": list(range(3, 40)), "b": [7], "c": list(range(100, 121)), "d": [5, 6, 7]}
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    driver.run(prompts, params, 3, chunk=9)
    driver.run({"e": list(range(10, 50))}, params, 2)
    after = _keys(launches)
    assert after, "the requests launched no kernel"
    assert after <= warmed, f"compiled after warm-up: {sorted(after - warmed)}"


def test_warm_up_is_skipped_where_nothing_compiles(tmp_path):
    runner, _ = make_runner(make_tiny_model(tmp_path / "tiny"), max_model_len=64)
    assert runner.backend.name != "triton"
    calls = []
    runner.execute_model = lambda sched: calls.append(sched)
    runner.warm_up()
    assert calls == []
