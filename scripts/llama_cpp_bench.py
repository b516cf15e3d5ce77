"""Single-stream decode of llama.cpp beside this engine on the same GGUF file (outside the tests).

Builds llama.cpp's llama-bench and llama-quantize from the llama-cpp-python sdist on PyPI, which
vendors llama.cpp (pip download, cmake, build -j2; kept under the engine's cache), writes an F32
copy of the file with llama-quantize, then alternates round by round: llama-bench's generation
of --new-tokens tokens on the file and on the F32 copy, and this engine's model runner decoding
as `python -m bench.single_stream` does, on the file quantized (--dtype auto) and dequantized
(--dtype float32). Prints JSON: every run, the medians, and the engine's ratio to llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine_limits import machine_info, memory_read_gbps
from bench.single_stream import decode_kv_bytes, decode_weight_bytes, load_runner, runner_decode
from config.default_model import cache_root, find_default_gguf


def build_llama_cpp(
    root: Path, version: str | None, targets: tuple[str, ...] = ("llama-bench", "llama-quantize")
) -> Path:
    """llama.cpp's build/bin with `targets` built from the llama-cpp-python sdist (once per
    version).

    The server is configured on (no curl, no web UI: nothing is downloaded at build time) so that
    scripts/llama_server_bench.py can build llama-server in the same build directory.
    """
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    dirs = sorted(root.glob("*/build/bin"))
    if dirs and not version and all((dirs[-1] / t).is_file() for t in targets):
        return dirs[-1]
    root.mkdir(parents=True, exist_ok=True)
    if not version and dirs:  # build the missing targets in the sdist already here
        source = dirs[-1].parent.parent
    else:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                spec,
                "-d",
                str(root),
            ],
            check=True,
        )
        sdist = max(root.glob("llama_cpp_python-*.tar.gz"), key=lambda p: p.stat().st_mtime)
        source = root / sdist.name.removesuffix(".tar.gz")
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    build = source / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source / "vendor" / "llama.cpp"),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
        ],
        check=True,
    )
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", *targets], check=True)
    return build / "bin"


def llama_bench(bin_dir: Path, gguf: Path, new_tokens: int, threads: int) -> float:
    """llama-bench's generation tokens/s (one repetition)."""
    out = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            "-m",
            str(gguf),
            "-p",
            "0",
            "-n",
            str(new_tokens),
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file (default model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--llama-cpp-version", default=None, help="llama-cpp-python sdist version")
    args = parser.parse_args()
    gguf = (args.model or find_default_gguf()).resolve()
    bin_dir = build_llama_cpp(cache_root() / "llama.cpp", args.llama_cpp_version)
    f32 = cache_root() / "llama.cpp" / f"{gguf.stem}.F32.gguf"
    if not f32.is_file():
        subprocess.run(
            [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"],
            check=True,
            capture_output=True,
        )
    threads = torch.get_num_threads()

    runners = {}
    for dtype in ("auto", "float32"):
        runners[dtype] = load_runner(str(gguf), dtype)
        runner_decode(runners[dtype], [1] * args.prompt_tokens, 16, -1)  # warm-up
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, runners["auto"].config.arch.vocab_size, args.prompt_tokens).tolist()
    runs: dict[str, list[float]] = {
        "llama.cpp file": [],
        "llama.cpp F32": [],
        "engine quantized": [],
        "engine float32": [],
    }
    for run in range(args.runs):
        runs["llama.cpp file"].append(llama_bench(bin_dir, gguf, args.new_tokens, threads))
        runs["engine quantized"].append(
            runner_decode(runners["auto"], prompt, args.new_tokens, run)
        )
        runs["llama.cpp F32"].append(llama_bench(bin_dir, f32, args.new_tokens, threads))
        runs["engine float32"].append(
            runner_decode(runners["float32"], prompt, args.new_tokens, run)
        )
    medians = {name: statistics.median(values) for name, values in runs.items()}
    gbps = memory_read_gbps()
    quantized_bytes = decode_weight_bytes(runners["auto"].model)
    # A step decoding token i attends to prompt + i positions: bench/single_stream.py's count.
    kv_bytes = decode_kv_bytes(runners["auto"].model, args.prompt_tokens + args.new_tokens / 2)
    result = {
        "workload": "single-stream decode tok/s",
        "machine": machine_info(),
        "model": str(gguf),
        "llama_cpp": str(bin_dir),
        "threads": threads,
        "runs": {name: [round(v, 2) for v in values] for name, values in runs.items()},
        "median_tok_s": {name: round(v, 2) for name, v in medians.items()},
        "engine_over_llama_cpp": {
            "file": round(medians["engine quantized"] / medians["llama.cpp file"], 2),
            "F32": round(medians["engine float32"] / medians["llama.cpp F32"], 2),
        },
        "memory_read_gb_s": round(gbps, 1),
        "quantized_weight_mb": round(quantized_bytes / 1e6, 1),
        "kv_mb_mean": round(kv_bytes / 1e6, 1),
        "engine_quantized_fraction_of_limit": round(
            medians["engine quantized"] * (quantized_bytes + kv_bytes) / (gbps * 1e9), 3
        ),
        "engine_quantized_fraction_weights_only": round(
            medians["engine quantized"] * quantized_bytes / (gbps * 1e9), 3
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
