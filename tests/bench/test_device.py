"""`engine bench device`: one short run on the CPU with the small shape, and its arithmetic."""

from __future__ import annotations

import json
import time

import pytest

from bench.device import nominal_bandwidth, weight_bytes_per_step
from bench.device_shapes import SHAPES
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
    argv += ["--output-len", "4", "--quick"]
    assert main(["bench", "device", *argv, "--gguf-type", "Q8_0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "float32"
    [variant] = result["variants"]
    assert (variant["name"], variant["gguf_type"], variant["quantization"]) == (
        "gguf-Q8_0",
        "Q8_0",
        None,
    )
    # Q8_0: 34 bytes per 32 weights; the 5 norms of hidden 256 in fp32.
    weights = 2 * (256 * 512 + 256 * 256 + 3 * 256 * 1024) + 32000 * 256
    assert variant["weight_bytes_per_step"] == weights // 32 * 34 + 5 * 256 * 4
    assert all(r["bytes_per_step"] > variant["weight_bytes_per_step"] for r in variant["runs"])


def test_bench_device_quantized_variants_against_the_dense_baseline(capsys):
    """--quantization fp8,gptq with --kv-cache-dtype fp8: the dense model with its own cache
    first, then the dense model with the fp8 cache, then each quantization with either cache
    (the fp8 cache compared on the same weights), with bytes and step-time ratios."""
    argv = ["--device", "cpu", "--shape", "small", "--batch-sizes", "1,3", "--context-len", "8"]
    argv += ["--output-len", "4", "--quick", "--quantization", "fp8,gptq"]
    assert main(["bench", "device", *argv, "--kv-cache-dtype", "fp8"]) == 0
    result = json.loads(capsys.readouterr().out)
    dense = 4 * (2 * (256 * 512 + 256 * 256 + 3 * 256 * 1024 + 512) + 256 + 32000 * 256)
    fp32_kv = 2 * 2 * 2 * 64 * 4  # 2 layers, K and V, 2 heads of 64, fp32
    assert result["weight_bytes_per_step"] == dense and result["kv_bytes_per_token"] == fp32_kv
    base = {r["batch_size"]: r for r in result["runs"]}
    assert set(base) == {1, 3} and all(set(r) == RUN_FIELDS for r in result["runs"])
    variants = {v["name"]: v for v in result["variants"]}
    assert list(variants) == ["kv-fp8", "fp8", "fp8+kv-fp8", "gptq", "gptq+kv-fp8"]
    assert [(v["quantization"], v["kv_cache_dtype"]) for v in variants.values()] == [
        (None, "fp8"),
        ("fp8", "auto"),
        ("fp8", "fp8"),
        ("gptq", "auto"),
        ("gptq", "fp8"),
    ]
    # On the CPU fp8 weights run dequantized into the dense layout: the dense bytes.
    assert variants["kv-fp8"]["weight_bytes_per_step"] == dense
    assert variants["fp8"]["weight_bytes_per_step"] == dense
    # gptq: 4-bit codes with a scale and offset per 128 in the C kernels' blocks (under 0.7
    # bytes a weight), the output projection and the norms as they were.
    quantized = 2 * (256 * 512 + 256 * 256 + 3 * 256 * 1024)
    rest = 4 * (32000 * 256 + 5 * 256)
    gptq_bytes = variants["gptq"]["weight_bytes_per_step"]
    assert 0.5 * quantized < gptq_bytes - rest < 0.7 * quantized
    assert variants["gptq+kv-fp8"]["weight_bytes_per_step"] == gptq_bytes
    for name, variant in variants.items():
        fp8_cache = name.endswith("kv-fp8")
        assert variant["kv_bytes_per_token"] == (fp32_kv // 4 if fp8_cache else fp32_kv)
        # The cache is compared on the same weights: the dense baseline or the variant before.
        weights = name.removesuffix("kv-fp8").removesuffix("+")
        same = {r["batch_size"]: r for r in variants[weights]["runs"]} if weights else base
        for r in variant["runs"]:
            b = base[r["batch_size"]]
            assert r["ms_ratio_to_baseline"] == round(r["ms_per_step"] / b["ms_per_step"], 3)
            assert r["kv_bytes_per_step"] * (4 if fp8_cache else 1) == b["kv_bytes_per_step"]
            if fp8_cache:
                ratio = round(r["ms_per_step"] / same[r["batch_size"]]["ms_per_step"], 3)
                assert r["ms_ratio_to_same_weights"] == ratio
            else:
                assert "ms_ratio_to_same_weights" not in r
        first = variant["targets"][0]["target"]
        against = "same weights, model's cache" if fp8_cache else "baseline"
        assert first.startswith(f"batch 1: step time / {against} <=")


def _run(batch: int, ms: float, ratio: float, graphs: bool = True, asynchronous: bool = True):
    return {
        "batch_size": batch,
        "cuda_graphs": graphs,
        "async_scheduling": asynchronous,
        "ms_per_step": ms,
        "ms_ratio_to_baseline": ratio,
    }


def test_targets_of_issue_32_read_the_graphs_and_async_runs():
    from bench.device_variants import target_checks

    def variant(q=None, gguf=None, kv="auto"):
        return {"quantization": q, "gguf_type": gguf, "kv_cache_dtype": kv}

    runs = [_run(1, 2.0, 0.5), _run(16, 2.2, 0.55), _run(64, 3.0, 0.7), _run(1, 9.0, 3.0, False)]
    fp8 = target_checks(variant("fp8"), runs)
    assert [(c["value"], c["met"]) for c in fp8] == [(0.5, True), (0.7, False)]
    int4 = target_checks(variant("gptq"), runs)
    assert [(c["value"], c["met"]) for c in int4] == [(0.5, False), (1.1, True), (0.7, True)]
    assert target_checks(variant(gguf="Q4_K"), runs)[0]["target"].endswith("<= 0.4")
    assert target_checks(variant(gguf="Q8_0"), runs) == []
    kv_runs = [r | {"ms_ratio_to_same_weights": 0.9} for r in runs]
    for kv_variant in (variant(kv="fp8"), variant("fp8", kv="fp8")):
        kv = target_checks(kv_variant, kv_runs)
        target = "batch 1: step time / same weights, model's cache <= 0.85"
        assert [(c["target"], c["value"], c["met"]) for c in kv] == [(target, 0.9, False)]


def test_model_weight_bytes_of_a_dense_model_equal_the_shape_arithmetic(tmp_path):
    """Counted from the loaded model's layouts (the CPU's re-laid dense weights), the figure
    weight_bytes_per_step gives from the shape."""
    from bench.device import model_weight_bytes
    from bench.device_shapes import write_model_dir
    from tests.worker.runner_utils import make_runner

    model = write_model_dir(tmp_path, "small")
    runner, _ = make_runner(model, load_format="dummy", max_model_len=64)
    assert model_weight_bytes(runner.model) == weight_bytes_per_step(runner.config.arch, 4)


def test_random_gguf_resolves_to_the_quantized_model(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as GGMLType

    from bench.device_shapes import model_config
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
        (["--gguf-type", "Q4_K", "--quantization", "fp8"], "pass one of the two flags"),
        (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype fp8_e5m2 is not supported"),
        (["--quantization", "gptq", "--dtype", "bfloat16"], "drop --dtype or pass --dtype float32"),
    ],
)
def test_bench_device_refuses_what_it_cannot_honour(argv, message, capsys):
    assert main(["bench", "device", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["gguf", "compressed-tensors", ",", "gguf-Q3_K", "fp8,int4"])
def test_bench_device_quantization_flag_names_what_it_runs(value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "device", "--quantization", value])
    err = capsys.readouterr().err
    assert "engine bench device runs --quantization fp8, gptq, awq or gguf-TYPE" in err
    assert f"got {value!r}" in err


def test_batch_sizes_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "device", "--batch-sizes", "1,x"])
    assert "expected positive integers such as 1,64, got '1,x'" in capsys.readouterr().err


def test_llama3_8b_shape_resolves_for_cuda_in_bf16(tmp_path):
    from bench.device_shapes import write_model_dir
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


def test_a_failing_variant_leaves_the_others_figures_and_exit_status_1(capsys, monkeypatch):
    from bench import device

    real = device._runs_of_variant

    def failing_gptq(engine_args, *rest, **kwargs):
        if engine_args.get("quantization") == "gptq":
            raise RuntimeError("no kernel")
        return real(engine_args, *rest, **kwargs)

    monkeypatch.setattr(device, "_runs_of_variant", failing_gptq)
    argv = ["--device", "cpu", "--shape", "small", "--batch-sizes", "1", "--context-len", "8"]
    argv += ["--output-len", "4", "--quick", "--quantization", "gptq,fp8"]
    assert main(["bench", "device", *argv]) == 1
    gptq, fp8 = json.loads(capsys.readouterr().out)["variants"]
    assert gptq["error"] == "RuntimeError('no kernel')" and "runs" not in gptq
    assert "error" not in fp8 and [r["batch_size"] for r in fp8["runs"]] == [1]
