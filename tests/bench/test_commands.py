"""`engine bench`: its workloads and flags, the single-stream workload through the offline API
and through the model runner alone, and a serving path that never imports the bench package."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import single_stream
from serve.cli import build_parser, main
from tests.tiny_models import make_tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp("bench") / "tiny", max_position_embeddings=2048
    )


@pytest.mark.parametrize(
    "workload", ["throughput", "prefix-shared", "single-stream", "null-model", "structured"]
)
def test_offline_workloads_take_their_flags(workload):
    args = build_parser().parse_args(
        [
            "bench",
            workload,
            "--in-process",
            "--no-hf",
            "--runs",
            "2",
            "--output-json",
            "f.json",
            "--max-model-len",
            "512",
        ]
    )
    assert (args.in_process, args.no_hf, args.runs, args.output_json) == (True, True, 2, "f.json")
    assert args.max_model_len == 512 and args.workload == workload


def test_serve_workload_takes_its_flags():
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--rate",
            "4",
            "--num-prompts",
            "8",
            "--prompt-len",
            "8",
            "16",
            "--output-json",
            "f.json",
        ]
    )
    assert (args.rate, args.num_prompts, args.prompt_len) == (4.0, 8, [8, 16])
    assert args.output_json == "f.json"


def test_single_stream_through_the_offline_api(tiny_model, tmp_path, capsys):
    out_file = tmp_path / "single.json"
    assert (
        main(
            [
                "bench",
                "single-stream",
                "--model",
                str(tiny_model),
                "--device",
                "cpu",
                "--runs",
                "1",
                "--kv-cache-memory",
                "16MiB",
                "--output-json",
                str(out_file),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out_file.read_text())
    assert set(result) == {"workload", "machine", "dtype", "engine_decode_tok_s", "runs"}
    assert result["workload"] == "single-stream" and result["dtype"] == "float32"
    assert len(result["runs"]) == 1 and result["engine_decode_tok_s"] == result["runs"][0] > 0
    assert {"cpu", "cpu_flags", "cores", "torch_threads", "device"} == set(result["machine"])


def test_single_stream_through_the_model_runner(tiny_model, capsys):
    single_stream.main(
        [
            "--model",
            str(tiny_model),
            "--dtype",
            "float32",
            "--runs",
            "2",
            "--new-tokens",
            "8",
            "--no-hf",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    runner = result["dtype=float32"]
    assert result["workload"] == "single-stream" and "torch" in result["machine"]
    assert len(runner["engine_runs"]) == 2 and runner["engine_decode_tok_s"] > 0
    assert runner["weight_mb"] > 0 and runner["fraction_of_limit"] > 0
    assert "ratio_vs_hf" not in runner and "hf_decode_tok_s" not in result


def test_the_workload_prompt_has_no_special_tokens(tiny_model):
    from tokenizer_proc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    prompt = single_stream.workload_prompt(tokenizer)
    assert len(prompt) == single_stream.PROMPT_TOKENS
    assert not set(prompt) & set(tokenizer.all_special_ids)


def test_the_serving_path_does_not_import_the_bench_package():
    code = (
        "import sys, frontend.api_server, serve.launcher, tokenizer_proc.tokenizer_proc, "
        "serve.cli; print([m for m in sys.modules if m == 'bench' or "
        "m.startswith('bench.')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
