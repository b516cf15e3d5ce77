"""EngineConfig: validation messages, sizes, dtype resolution, limits taken from the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from config.attention import attention_backends_for
from config.cache import BLOCK_SIZES
from config.engine import EngineConfig, _resolve_dtype, decode_config, engine_config_from_kwargs
from config.errors import ConfigError
from config.sizes import parse_size
from engine_core.resolve import resolved_config
from gpu_worker.model_runner import ModelRunner
from tests.tiny_models import make_tiny_model

# The tiny model: 4 attention heads, 2 KV heads, 2 layers, head_dim 16, 512 positions.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head_dim, fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _resolved(model_dir: Path, **kwargs) -> EngineConfig:
    kwargs.setdefault("device", "cpu")
    return resolved_config(model=str(model_dir), **kwargs)


# --- per-field validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype must be one of auto, float32, .* got 'float64'"),
        ({"dtype": "fp16"}, "dtype must be one of .*got 'fp16'"),
        ({"block_size": 24}, re.escape(f"block_size must be one of {BLOCK_SIZES}, got 24")),
        ({"block_size": 0}, "block_size must be one of .*got 0"),
        (
            {"gpu_memory_utilization": 0.0},
            re.escape("gpu_memory_utilization must be in (0, 1], got 0.0"),
        ),
        (
            {"gpu_memory_utilization": 1.5},
            re.escape("gpu_memory_utilization must be in (0, 1], got 1.5"),
        ),
        ({"gpu_memory_utilization": -0.2}, re.escape("must be in (0, 1], got -0.2")),
        ({"max_model_len": 0}, "max_model_len must be positive, got 0"),
        ({"max_logprobs": -2}, "max_logprobs must be -1 or non-negative, got -2"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be positive, got 0"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot parse size 'lots'"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be at least 1"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo must be one of .*'md5'"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1, got 0"),
        (
            {"scheduling_policy": "lifo"},
            "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1, got 0"),
        (
            {"load_format": "pt"},
            "load_format must be one of auto, safetensors, gguf, dummy, got 'pt'",
        ),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda, got 'tpu'"),
    ],
)
def test_invalid_values_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_kwargs(**kwargs)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_allowed_block_sizes(block_size):
    assert engine_config_from_kwargs(block_size=block_size).cache.block_size == block_size


def test_gpu_memory_utilization_upper_bound_is_allowed():
    assert engine_config_from_kwargs(gpu_memory_utilization=1.0).cache.gpu_memory_utilization == 1.0


def test_unknown_engine_arguments_are_named():
    with pytest.raises(ConfigError, match=r"unknown engine argument\(s\): blocksize, modle$"):
        engine_config_from_kwargs(modle="x", block_size=16, blocksize=16)


def test_kwargs_reach_their_groups():
    cfg = engine_config_from_kwargs(
        dtype="half",
        block_size=32,
        max_num_seqs=8,
        tensor_parallel_size=2,
        load_format="dummy",
        device="cpu",
        kv_cache_memory="1MiB",
        enable_prefix_caching=False,
    )
    assert (cfg.model.dtype, cfg.cache.block_size, cfg.scheduler.max_num_seqs) == ("half", 32, 8)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.load.load_format == "dummy"
    assert cfg.device.device == "cpu" and cfg.cache.kv_cache_memory == 2**20
    assert cfg.cache.enable_prefix_caching is False


def test_the_ray_backend_without_ray_says_how_to_install_it(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"'ray' needs Ray, which is not installed: "
        r"pip install ray \(the engine's \[ray\] extra\)",
    ):
        engine_config_from_kwargs(distributed_executor_backend="ray", tensor_parallel_size=2)


def test_config_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)


# --- parse_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2GiB", 2 * 2**30),
        ("512MB", 512 * 10**6),
        (1000, 1000),
        ("1000", 1000),
        ("1e9", 10**9),
        ("64MiB", 64 * 2**20),
        ("4kib", 4096),
        (" 3 KB ", 3000),
        ("1.5GiB", 3 * 2**29),
        ("2g", 2 * 10**9),
        ("1TiB", 2**40),
        ("7b", 7),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value", ["", "lots", "2XB", "GiB", "-1GB", "1.2.3GB", "e", "2 GiB x", "0x10"]
)
def test_parse_size_refuses_bad_strings(value):
    with pytest.raises(ValueError, match=re.escape(f"cannot parse size {value!r}") + ".*2GiB"):
        parse_size(value)


# --- resolution against the model --------------------------------------------------------


def test_auto_dtype_is_float32_on_cpu(tiny):
    assert _resolved(tiny).torch_dtype_name == "float32"
    assert _resolved(tiny, dtype="auto").device_type == "cpu"


@pytest.mark.parametrize(
    "requested, resolved",
    [
        ("float32", "float32"),
        ("float", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("half", "float16"),
    ],
)
def test_explicit_dtypes_and_aliases(tiny, requested, resolved):
    assert _resolved(tiny, dtype=requested).torch_dtype_name == resolved


@pytest.mark.parametrize(
    "checkpoint, device, resolved",
    [
        ("float32", "cpu", "float32"),
        ("bfloat16", "cpu", "float32"),
        ("float16", "cpu", "float32"),
        ("float32", "cuda", "bfloat16"),
        ("bfloat16", "cuda", "bfloat16"),
        ("float16", "cuda", "float16"),
    ],
)
def test_auto_dtype_resolution(checkpoint, device, resolved):
    assert _resolve_dtype("auto", checkpoint, device) == resolved


def test_default_max_model_len_comes_from_the_model(tiny):
    cfg = _resolved(tiny)
    assert cfg.model.max_model_len == cfg.max_model_len == 512
    assert cfg.arch.max_position_embeddings == 512
    assert cfg.model_path == str(tiny)


def test_max_model_len_below_the_model_limit_is_kept(tiny):
    assert _resolved(tiny, max_model_len=100).max_model_len == 100


def test_max_model_len_above_the_model_limit(tiny):
    with pytest.raises(
        ConfigError, match="max_model_len 1024 exceeds the model's max_position_embeddings 512"
    ):
        _resolved(tiny, max_model_len=1024)


def test_max_model_len_needs_resolve():
    with pytest.raises(AssertionError, match="resolve"):
        _ = engine_config_from_kwargs(device="cpu").max_model_len


@pytest.mark.parametrize("tp", [3, 4])
def test_tensor_parallel_size_must_divide_heads(tiny, tp):
    # 4 attention heads, 2 KV heads: 3 divides neither, 4 divides only the attention heads.
    with pytest.raises(
        ConfigError,
        match=f"tensor_parallel_size {tp} must divide the number of "
        r"attention heads \(4\) and of KV heads \(2\)",
    ):
        _resolved(tiny, tensor_parallel_size=tp)


def test_tensor_parallel_size_dividing_heads_is_accepted(tiny):
    assert _resolved(tiny, tensor_parallel_size=2).parallel.tensor_parallel_size == 2


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope"))):
        _resolved(tmp_path / "nope")


# --- KV cache sizing ---------------------------------------------------------------------


def _num_blocks(model_dir: Path, **kwargs) -> int:
    return ModelRunner(_resolved(model_dir, **kwargs), torch.device("cpu")).determine_num_blocks()


def test_kv_cache_memory_sets_the_number_of_blocks(tiny):
    per_block = KV_BYTES_PER_TOKEN * 16
    assert _num_blocks(tiny, kv_cache_memory="1MiB") == 2**20 // per_block
    assert _num_blocks(tiny, kv_cache_memory=100 * per_block + 5) == 100
    assert _num_blocks(tiny, num_gpu_blocks_override=40) == 40


def test_kv_cache_exactly_one_max_len_request_fits(tiny):
    # 512 tokens in blocks of 16: 32 blocks.
    assert _num_blocks(tiny, kv_cache_memory=32 * 16 * KV_BYTES_PER_TOKEN) == 32


def test_kv_cache_too_small_for_one_request(tiny):
    with pytest.raises(
        ValueError,
        match=r"the KV cache holds 31 blocks of 16 tokens .* fewer than "
        r"the 32 blocks one request of max_model_len 512 needs.*kv_cache_memory",
    ):
        _num_blocks(tiny, kv_cache_memory=32 * 16 * KV_BYTES_PER_TOKEN - 1)


def test_kv_cache_too_small_by_block_override(tiny):
    with pytest.raises(
        ValueError,
        match="holds 4 blocks of 32 tokens.*fewer than the 7 blocks "
        "one request of max_model_len 200 needs",
    ):
        _num_blocks(tiny, num_gpu_blocks_override=4, block_size=32, max_model_len=200)


def test_lower_max_model_len_fits_a_small_cache(tiny):
    assert _num_blocks(tiny, kv_cache_memory="64KiB", max_model_len=100) == 8


def test_async_scheduling_flag():
    import argparse

    from config.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "async_scheduling" not in engine_kwargs(parser.parse_args([]))
    kwargs = engine_kwargs(parser.parse_args(["--async-scheduling"]))
    assert kwargs == {"async_scheduling": True}
    assert engine_config_from_kwargs(**kwargs).scheduler.async_scheduling is True
    assert engine_kwargs(parser.parse_args(["--no-async-scheduling"])) == {
        "async_scheduling": False
    }


def test_async_scheduling_defaults_on_with_a_gpu_off_on_the_cpu(tiny):
    def resolved(**kwargs):
        return resolved_config(model=str(tiny), **kwargs).scheduler

    assert resolved(device="cpu").async_scheduling is False
    assert resolved(device="cuda").async_scheduling is True
    assert resolved(device="cuda", async_scheduling=False).async_scheduling is False
    assert resolved(device="cpu", async_scheduling=True).async_scheduling is True


# --- attention kernel limits, checked when the configuration is resolved ---------------------


def _model_with_head_dim(directory: Path, head_dim: int) -> Path:
    """A config.json and an empty weights file (resolve() checks the file is there and reads
    none) for a Llama with this head size."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4 * head_dim,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": head_dim,
                "vocab_size": 128,
                "max_position_embeddings": 256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return directory


CUDA_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# The Triton kernels pad head sizes that are not powers of two (multiples of 8 up to 256).
CUDA_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 192, 256)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", [8, 16, 48, 64, 80, 96, 128, 192, 256, 512])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_refuses_nothing(block_size, head_dim, dtype):
    # The torch backend runs any shape; the C kernels are only preferred where they apply.
    names = attention_backends_for("cpu", block_size, head_dim, dtype)
    assert names[-1] == "torch"
    c_kernel = dtype == "float32" and head_dim in (64, 128) and block_size % 16 == 0
    assert ("cpu" in names) == c_kernel


@pytest.mark.parametrize("head_dim", [48, 80, 96])
def test_cpu_resolves_odd_head_sizes_and_any_block_size(tmp_path, head_dim):
    model = _model_with_head_dim(tmp_path, head_dim)
    for block_size in BLOCK_SIZES:
        cfg = _resolved(model, block_size=block_size, dtype="bfloat16")
        assert (cfg.device_type, cfg.arch.head_dim) == ("cpu", head_dim)


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_cuda_accepts_the_triton_kernels_block_sizes(tiny, block_size, dtype):
    # Resolving with device 'cuda' declared needs no GPU: it loads nothing.
    cfg = _resolved(tiny, device="cuda", block_size=block_size, dtype=dtype)
    assert cfg.device_type == "cuda"


def test_cuda_refuses_block_size_256_naming_the_supported_ones(tiny):
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "block_size 256 is not supported by the triton attention kernels on cuda, which take "
            "block_size 1, 8, 16, 32, 64 or 128"
        ),
    ):
        _resolved(tiny, device="cuda", block_size=256)


@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS)
def test_cuda_accepts_padded_head_sizes(tmp_path, head_dim):
    cfg = _resolved(_model_with_head_dim(tmp_path, head_dim), device="cuda")
    assert cfg.arch.head_dim == head_dim


@pytest.mark.parametrize("head_dim", [8, 100, 264, 512])
def test_cuda_refuses_other_head_sizes_before_loading(tmp_path, head_dim):
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"head_dim {head_dim} is not supported by the triton attention kernels on cuda, which "
            "take head_dim a multiple of 8 from 16 to 256"
        ),
    ):
        _resolved(_model_with_head_dim(tmp_path, head_dim), device="cuda")


def test_rules_for_a_named_device_type():
    assert attention_backends_for("cuda", 16, 128, "bfloat16") == ["triton"]
    assert attention_backends_for("cpu", 16, 64, "float32") == ["cpu", "torch"]
    with pytest.raises(
        ConfigError,
        match="dtype float64 is not supported by the triton attention "
        "kernels on cuda, which take dtype float16, bfloat16 or float32",
    ):
        attention_backends_for("cuda", 16, 128, "float64")
    with pytest.raises(ConfigError, match="no attention backend for device type 'tpu'"):
        attention_backends_for("tpu", 16, 128, "float32")


def test_backend_selection_uses_the_same_rules():
    from gpu_worker.attention.select import attention_backend

    cuda = torch.device("cuda")  # only named: nothing is allocated on it
    assert attention_backend(cuda, torch.bfloat16, 128, 128).name == "triton"
    with pytest.raises(ConfigError, match="block_size 256 is not supported"):
        attention_backend(cuda, torch.bfloat16, 128, 256)
    assert attention_backend(cuda, torch.bfloat16, 96, 16).name == "triton"  # Phi-3-mini
    with pytest.raises(ConfigError, match="head_dim 100 is not supported"):
        attention_backend(cuda, torch.float16, 100, 16)
    assert attention_backend(torch.device("cpu"), torch.float32, 80, 256).name == "torch"
    assert attention_backend(torch.device("cpu"), torch.bfloat16, 64, 16).name == "torch"


def test_the_encoded_configuration_is_the_resolved_one(tiny):
    """What the launcher hands every process (EngineConfig.encode) decodes to the same
    configuration, served names and generation defaults included, without resolving again."""
    config = _resolved(
        tiny,
        served_model_name=["a", "b", "a"],
        dtype="float32",
        override_generation_config={"temperature": 0.5},
    )
    copy = decode_config(config.encode())
    assert copy == config
    assert copy.model.served_model_names == ["a", "b"] and copy.model.served_model_name == "a"
    assert copy.sampling_defaults == {"temperature": 0.5} and copy.arch == config.arch
    ranked = config.for_rank(1)
    assert ranked.parallel.data_parallel_rank == 1 and config.parallel.data_parallel_rank is None
    with pytest.raises(ConfigError, match="not an encoded engine configuration"):
        decode_config('{"model": {"dtype": 3}}')
