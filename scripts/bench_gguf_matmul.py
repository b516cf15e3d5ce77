"""Time the Triton GGUF matmul (kernels/triton/gguf_matmul.py) on a model's projection shapes
against cuBLAS on the same weights dequantized to bf16, on a GPU.

    python scripts/bench_gguf_matmul.py [--types Q4_K,Q8_0] [--rows 1,4,16,64]

Weights are random codes with small scales (timing only). Per type and row count: the time of
one decode step's projections (every layer's qkv, o, gate_up and down plus the output
projection, timed once each and multiplied by the layer count), the bytes they read, and the
rate; the bf16 line is the same step on dense weights. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType

from bench.random_gguf import random_blocks
from kernels.gguf_device import pack_device
from kernels.triton import gguf_matmul

# Llama-3-8B: (name, out, in, per layer?)
SHAPES = {
    "llama3-8b": (
        32,
        [
            ("qkv", 6144, 4096),
            ("o", 4096, 4096),
            ("gate_up", 28672, 4096),
            ("down", 4096, 14336),
        ],
        ("lm_head", 128256, 4096),
    ),
}


def random_weight(qtype: GGMLType, n: int, k: int, device: torch.device):
    raw = random_blocks(qtype, n, k, np.random.default_rng(0))
    return pack_device(qtype, raw, n, k, device)


def time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    device = torch.device("cuda")
    layers, per_layer, head = SHAPES[args.shape]
    shapes = [(*s, layers) for s in per_layer] + [(*head, 1)]
    rows_list = [int(r) for r in args.rows.split(",")]
    for rows in rows_list:
        total_us = total_bytes = 0.0
        for _, n, k, count in shapes:
            w = torch.empty(n, k, dtype=torch.bfloat16, device=device).uniform_(-0.05, 0.05)
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
            total_us += time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * count
            total_bytes += w.numel() * 2 * count
            del w
        print(
            json.dumps(
                {
                    "type": "bf16 cuBLAS",
                    "rows": rows,
                    "step_ms": round(total_us / 1e3, 3),
                    "GB": round(total_bytes / 1e9, 2),
                    "TB_per_s": round(total_bytes / total_us / 1e6, 3),
                }
            ),
            flush=True,
        )
    for name in args.types.split(","):
        qtype = GGMLType[name]
        weights = [(random_weight(qtype, n, k, device), k, count) for _, n, k, count in shapes]
        for rows in rows_list:
            total_us = total_bytes = 0.0
            parts = {}
            for (label, *_), (w, k, count) in zip(shapes, weights, strict=True):
                x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
                us = time_us(lambda w=w, x=x: gguf_matmul.matmul(x, w))
                parts[label] = round(us, 1)
                total_us += us * count
                total_bytes += w.nbytes * count
            print(
                json.dumps(
                    {
                        "type": name,
                        "rows": rows,
                        "step_ms": round(total_us / 1e3, 3),
                        "GB": round(total_bytes / 1e9, 2),
                        "TB_per_s": round(total_bytes / total_us / 1e6, 3),
                        "us_per_call": parts,
                    }
                ),
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
