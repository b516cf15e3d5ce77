"""`engine bench device`: one short run on the CPU with the small shape, and its arithmetic."""

from __future__ import annotations

import json
import time

import pytest

from bench.device import SHAPES, nominal_bandwidth, weight_bytes_per_step
from config.model_arch import ModelArchConfig
from serve.cli import main

RUN_FIELDS = {
    "batch_size",
    "async_scheduling",
    "cuda_graphs",
    "ms_per_step",
    "output_tok_s",
    "steps_timed",
    "kv_bytes_per_step",
    "bytes_per_step",
    "fraction_of_bandwidth_limit",
}


def test_bench_device_on_cpu_prints_its_figures(tmp_path, capsys):
    out_file = tmp_path / "device.json"
    start = time.perf_counter()
    rc = main(
        [
            "bench",
            "device",
            "--device",
            "cpu",
            "--shape",
            "small",
            "--batch-sizes",
            "1,4",
            "--context-len",
            "16",
            "--output-len",
            "5",
            "--output-json",
            str(out_file),
        ]
    )
    elapsed = time.perf_counter() - start
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out_file.read_text())
    assert result["workload"] == "device"
    assert (result["device_type"], result["shape"]) == ("cpu", "small")
    assert (result["dtype"], result["context_len"], result["output_len"]) == ("float32", 16, 5)
    assert {"cpu", "cores", "device"} <= set(result["machine"])
    bandwidth = result["bandwidth_gb_s"]
    assert bandwidth["nominal"] is None and bandwidth["limit"] == bandwidth["measured_copy"] > 0
    # 2 layers of hidden 256 (4 heads, 2 KV heads of 64), MLP 1024, vocab 32000, fp32.
    assert result["weight_bytes_per_step"] == 4 * (
        2 * (256 * 512 + 256 * 256 + 3 * 256 * 1024 + 512) + 256 + 32000 * 256
    )
    assert result["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4
    runs = result["runs"]
    assert [(r["batch_size"], r["async_scheduling"]) for r in runs] == [
        (1, False),
        (4, False),
        (1, True),
        (4, True),
    ]
    mixed = result["offline_mixed"]
    assert [(m["cuda_graphs"], m["async_scheduling"]) for m in mixed] == [
        (False, False),
        (False, True),
    ]
    assert all(0 < m["output_tok_s"] < m["total_tok_s"] for m in mixed)
    for r in runs:
        assert set(r) == RUN_FIELDS
        # Five tokens: the first from the prefill, then four decode steps, three intervals.
        assert r["steps_timed"] == 3 and r["ms_per_step"] > 0
        # Above 1 where the small CPU shape's weights (36 MB) stay in the last-level cache
        # between steps (the fused greedy head writes no logits to push them out); the bound
        # catches a unit error (a factor of 1000), not a speed.
        assert 0 < r["fraction_of_bandwidth_limit"] < 20
        # Contexts of 17..20 positions; the timed steps are the last three (18, 19, 20).
        kv = r["batch_size"] * 19 * result["kv_bytes_per_token"]
        assert r["kv_bytes_per_step"] == kv
        assert r["bytes_per_step"] == result["weight_bytes_per_step"] + kv
    assert elapsed < 30


def test_bench_device_runs_gguf_blocks_kept_quantized(tmp_path, capsys):
    """--gguf-type: a random GGUF file of the shape, loaded quantized; a step reads its blocks."""
    argv = ["--device", "cpu", "--shape", "small", "--batch-sizes", "2", "--context-len", "8"]
    assert main(["bench", "device", *argv, "--output-len", "4", "--gguf-type", "Q8_0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["gguf_type"], result["dtype"]) == ("Q8_0", "float32")
    # Q8_0: 34 bytes per 32 weights; the 5 norms of hidden 256 in fp32.
    weights = 2 * (256 * 512 + 256 * 256 + 3 * 256 * 1024) + 32000 * 256
    assert result["weight_bytes_per_step"] == weights // 32 * 34 + 5 * 256 * 4
    assert all(r["bytes_per_step"] > result["weight_bytes_per_step"] for r in result["runs"])


def test_random_gguf_resolves_to_the_quantized_model(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as GGMLType

    from bench.device import model_config
    from bench.random_gguf import prepare_cache_dir, write_random_gguf
    from engine_core.resolve import resolved_config

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_random_gguf(tmp_path / "m.gguf", model_config("small"), GGMLType.Q4_K)
    prepare_cache_dir(path, model_config("small"))
    config = resolved_config(model=str(path), device="cpu")
    assert config.model.quantization == "gguf" and config.arch.hidden_size == 256


def test_llama3_8b_weights_read_per_step():
    arch = ModelArchConfig.from_dict({"architectures": ["LlamaForCausalLM"], **SHAPES["llama3-8b"]})
    # Llama-3-8B has 8,030,261,248 parameters; a step reads all but the 128256 x 4096 embedding.
    assert weight_bytes_per_step(arch, 2) == 2 * (8_030_261_248 - 128256 * 4096)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA A10G", None),
        ("cpu", None),
    ],
)
def test_nominal_bandwidth_by_gpu_name(name, expected):
    assert nominal_bandwidth(name) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "x"], "sets --model itself"),
        (["--load-format", "safetensors"], "sets --load-format itself"),
        (["--max-model-len", "4k"], "sets --max-model-len itself"),
        (["--async-scheduling"], "sets --async-scheduling itself"),
        (["--output-len", "2"], "--output-len must be at least 3"),
        (["--quantization", "gguf"], "pass --gguf-type"),
    ],
)
def test_bench_device_refuses_what_it_cannot_honour(argv, message, capsys):
    assert main(["bench", "device", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_batch_sizes_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "device", "--batch-sizes", "1,x"])
    assert "expected positive integers such as 1,64, got '1,x'" in capsys.readouterr().err


def test_llama3_8b_shape_resolves_for_cuda_in_bf16(tmp_path):
    from bench.device import write_model_dir
    from engine_core.resolve import resolved_config

    cfg = resolved_config(
        model=str(write_model_dir(tmp_path, "llama3-8b")), device="cuda", load_format="dummy"
    )
    assert cfg.torch_dtype_name == "bfloat16" and cfg.max_model_len == 131072
    arch = cfg.arch
    assert (arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim) == (32, 8, 128)
    assert cfg.arch.rope_theta == 500000.0 and cfg.arch.rope_scaling["rope_type"] == "llama3"


def test_step_overhead_reports_phases(tmp_path):
    from bench.overhead import step_overhead
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    res = step_overhead(
        # Without async scheduling (CUDA's default), whose last step tells the workers who
        # finished after one more launch.
        {
            "model": str(model),
            "max_num_seqs": 8,
            "max_model_len": 64,
            "async_scheduling": False,
            # The phases are host timings: on a GPU they time launches, not the work.
            "device": "cpu",
        },
        num_requests=8,
        prompt_len=4,
        output_len=5,
    )
    # A prefill step that samples, four decodes, and one that tells the workers who finished.
    assert res["steps"] == 6
    phases = res["phases_ms"]
    assert {
        "schedule",
        "update_from_output",
        "prepare",
        "post_update",
        "forward",
        "get_output",
    } <= set(phases)
    # Greedy steps: the output projection and argmax fused where the C kernels run, else
    # logits then the sampler.
    head = {"greedy_tokens"} if "greedy_tokens" in phases else {"compute_logits", "sampler"}
    assert head <= set(phases)
    assert res["model_ms"] == pytest.approx(
        phases["forward"] + sum(phases[p] for p in head), abs=0.02
    )
    assert res["ms_per_step"] >= res["model_ms"] + res["overhead_ms"] - 0.05
