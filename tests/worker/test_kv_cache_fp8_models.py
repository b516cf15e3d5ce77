"""--kv-cache-dtype fp8 through the engine: the configuration takes it (and refuses what no
backend runs), the cache holds twice the blocks of a bf16 cache and four times an fp32 one's in
the same memory, and whole models generate on the CPU through the C and the torch backends, with
the checkpoint's scales (Attention.k_scale / v_scale) or 1.0, close to the fp32 cache."""

from __future__ import annotations

import pytest
import torch

from config.attention import AttentionFeatures
from config.errors import ConfigError
from engine_core.resolve import resolved_config
from gpu_worker.attention.select import attention_backend
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.kv_cache import allocate_kv_caches, kv_block_bytes, kv_cache_torch_dtype
from gpu_worker.model_runner import ModelRunner
from kernels import cpu_binding
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, make_tiny_model_with_tokenizer
from tests.worker.runner_utils import make_runner, random_prompts

NEW_TOKENS = 8
# Weights large enough that keys and values span many fp8 exponents.
SHARP = {"initializer_range": 0.1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """head_dim 16: the torch backend on the CPU."""
    return make_tiny_model(tmp_path_factory.mktemp("fp8kv16"), "llama", **SHARP)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """head_dim 64: the C backend on the CPU."""
    return make_tiny_model(
        tmp_path_factory.mktemp("fp8kv64"),
        "llama",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        **SHARP,
    )


def _num_blocks(model, **kwargs) -> int:
    config = resolved_config(model=str(model), device="cpu", **kwargs)
    return ModelRunner(config, torch.device("cpu")).determine_num_blocks()


def test_an_fp8_cache_holds_twice_a_bf16_caches_blocks(tiny):
    memory = 4 * 2**20
    fp32 = _num_blocks(tiny, kv_cache_memory=memory)
    bf16 = _num_blocks(tiny, kv_cache_memory=memory, dtype="bfloat16")
    fp8 = _num_blocks(tiny, kv_cache_memory=memory, kv_cache_dtype="fp8")
    fp8_bf16 = _num_blocks(tiny, kv_cache_memory=memory, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8 == fp8_bf16 == 2 * bf16 == 4 * fp32
    # 2 layers x K and V x 2 KV heads x head_dim 16 x 16 tokens, one byte each: 2 KiB a block.
    assert fp8 == memory // 2048


def test_the_fp8_cache_tensors_fill_the_memory_they_were_sized_for(tiny):
    config = resolved_config(model=str(tiny), device="cpu", kv_cache_memory="1MiB")
    arch = config.arch
    assert arch is not None
    dtype = kv_cache_torch_dtype("fp8", torch.float32)
    assert dtype == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    per_block = kv_block_bytes(arch, 16, dtype)
    caches = allocate_kv_caches(
        arch, 2**20 // per_block, 16, dtype, torch.device("cpu"), lambda *s: (2, *s)
    )
    assert all(c.dtype == dtype for c in caches)
    assert sum(c.numel() * c.element_size() for c in caches) == 2**20


def test_the_configuration_takes_fp8_and_names_what_it_refuses(tiny):
    assert (
        resolved_config(
            model=str(tiny), device="cpu", kv_cache_dtype="fp8_e4m3"
        ).cache.kv_cache_dtype
        == "fp8"
    )
    with pytest.raises(ConfigError, match="fp8_e5m2 is not supported"):
        resolved_config(model=str(tiny), device="cpu", kv_cache_dtype="fp8_e5m2")


def test_cuda_below_compute_capability_8_9_is_refused(monkeypatch):
    """Triton compiles float8_e4m3fn loads from 8.9 (Ada, Hopper) only."""
    fp8 = AttentionFeatures(kv_cache_dtype="fp8")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or newer.*has 8\.0"):
        attention_backend(cuda, torch.bfloat16, 128, 16, fp8)
    assert attention_backend(cuda, torch.bfloat16, 128, 16).name == "triton"  # auto: any
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention_backend(cuda, torch.bfloat16, 128, 16, fp8).name == "triton"


def _generate(model, scales: tuple[float, float] | None = None, backend=None, **engine_args):
    runner, driver = make_runner(model, backend, **engine_args)
    if scales is not None:  # as the loader sets a checkpoint's k_scale / v_scale
        for attn in runner.model.attention_layers():
            attn.k_scale, attn.v_scale = scales
    # The scales each layer hands the backend: only with an fp8 cache (backend contract).
    seen: set[tuple[float, float] | None] = set()
    forward = runner.backend.forward

    def recording(*args, **kwargs):
        seen.add((kwargs["k_scale"], kwargs["v_scale"]) if "k_scale" in kwargs else None)
        return forward(*args, **kwargs)

    runner.backend.forward = recording  # type: ignore[method-assign]
    prompts = random_prompts(runner.arch.vocab_size, [5, 23, 40])
    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=5)
    tokens = driver.run(prompts, params, NEW_TOKENS, chunk=16)
    return runner, driver, tokens, seen


def _assert_logprobs_close(got, want, steps: int | None = None, **tolerance) -> None:
    """Each step's top-5 logprobs (values, so near ties that swap ids compare) within
    tolerance, up to `steps` steps or the step where the sampled tokens part."""
    for got_step, want_step in list(zip(got, want, strict=True))[:steps]:
        torch.testing.assert_close(
            torch.tensor(got_step.logprobs[0][1:]),
            torch.tensor(want_step.logprobs[0][1:]),
            **tolerance,
        )
        if got_step.token_ids[0][0] != want_step.token_ids[0][0]:
            break


@pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler")
@pytest.mark.parametrize("scales", [None, (0.05, 0.03)], ids=["unit", "scaled"])
def test_the_c_and_torch_backends_generate_alike_from_an_fp8_cache(tiny64, scales):
    """Two implementations of the fp8 cache (the C kernels, the torch ops) in a whole model:
    the same greedy tokens and close logprobs; and each prompt's first token is the fp32
    cache's."""
    _, ref_driver, expected, ref_seen = _generate(tiny64)
    c_runner, c_driver, c_tokens, c_seen = _generate(tiny64, scales, kv_cache_dtype="fp8")
    torch_backend = TorchAttentionBackend()
    _, t_driver, t_tokens, t_seen = _generate(tiny64, scales, torch_backend, kv_cache_dtype="fp8")
    # The layers hand their scales over with an fp8 cache only.
    assert ref_seen == {None} and c_seen == t_seen == {scales or (1.0, 1.0)}
    assert c_runner.backend.name == "cpu"
    assert all(c.dtype == torch.float8_e4m3fn for c in c_runner.kv_caches)
    assert c_tokens == t_tokens
    for req, want in expected.items():
        # Float differences upstream (summation orders) flip a value's fp8 rounding now and
        # then: thousandths here, where a scale the kernel dropped moves them by tenths.
        _assert_logprobs_close(c_driver.logprobs[req], t_driver.logprobs[req], atol=0.01, rtol=0)
        assert c_tokens[req][0] == want[0], req
        # fp8's rounding of K and V (relative steps of 1/16) moves this sharp model's logprobs
        # by tenths.
        _assert_logprobs_close(
            c_driver.logprobs[req], ref_driver.logprobs[req], 1, atol=0.5, rtol=0
        )


def test_the_torch_backend_generates_from_an_fp8_cache(tiny):
    _, ref_driver, expected, _ = _generate(tiny)
    runner, driver, tokens, seen = _generate(tiny, (0.05, 0.03), kv_cache_dtype="fp8")
    assert seen == {(0.05, 0.03)}
    assert runner.backend.name == "torch"
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    for req, want in expected.items():
        assert tokens[req][0] == want[0], req
        _assert_logprobs_close(driver.logprobs[req], ref_driver.logprobs[req], 1, atol=0.5, rtol=0)


def test_a_checkpoints_kv_scales_reach_the_fp8_cache(tmp_path):
    """A compressed-tensors FP8 checkpoint with a kv_cache_scheme (per-layer k_scale 0.5 / 1.5,
    v_scale 0.25, written by the quantized-checkpoint tests' own writer): with an fp8 cache each
    layer hands the backend its checkpoint's scales, and the first tokens are the model's with
    the cache in fp32."""
    from tests.worker.test_quantized_checkpoints import write_checkpoint

    dense = make_tiny_model_with_tokenizer(tmp_path / "dense", initializer_range=0.2)
    write_checkpoint(dense, tmp_path / "ct", "ct-fp8-tensor-static")
    _, ref_driver, expected, _ = _generate(tmp_path / "ct", max_model_len=128)
    runner, driver, tokens, seen = _generate(
        tmp_path / "ct", kv_cache_dtype="fp8", max_model_len=128
    )
    assert seen == {(0.5, 0.25), (1.5, 0.25)}
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    for req, want in expected.items():
        assert tokens[req][0] == want[0], req
        _assert_logprobs_close(driver.logprobs[req], ref_driver.logprobs[req], 1, atol=0.5, rtol=0)


def test_engine_generate_runs_with_an_fp8_cache(tmp_path, capsys):
    from serve.cli import main

    model_dir = make_tiny_model_with_tokenizer(tmp_path / "m", **SHARP)
    argv = ["generate", "The fp8 cache", "--model", str(model_dir), "--max-tokens", "6"]
    argv += ["--ignore-eos", "--device", "cpu", "--max-model-len", "64"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 0
    assert capsys.readouterr().out == expected
