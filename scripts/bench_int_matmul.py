"""Time the quantized CUDA linear methods on a model's projection shapes against cuBLAS on bf16
weights, on a GPU: the Triton int GEMM (kernels/triton/int_matmul.py: int4 groups of 128 as
GPTQ/AWQ, int8 per channel, GGUF Q4_K converted) and FP8 (W8A8 through torch._scaled_mm where
the device has FP8 tensor cores, with the per-token activation quantizer).

    python scripts/bench_int_matmul.py [--variants int4-g128,fp8-w8a8] [--rows 1,4,16,64]

Weights are random codes with small scales (timing only). Per variant and row count: one decode
step's projections (every layer's qkv, o, gate_up and down plus the output projection, each
timed once in a CUDA graph and multiplied by the layer count), the bytes they read, the rate,
and the ratio to bf16's step at the same rows. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Sequence

import torch

from kernels.quant_weights import IntWeight, quantize_fp8
from scripts.bench_gguf_matmul import SHAPES, time_us

VARIANTS = ("int4-g128", "int8-channel", "gguf-Q4_K", "fp8-w8a8", "fp8-weight-only")


def _int_weight(bits: int, group: int, n: int, k: int, device: torch.device) -> IntWeight:
    group = k if group <= 0 else group
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, device=device)
    scales = torch.rand(n, k // group, device=device) * 1e-3 + 1e-4
    return IntWeight(codes, scales, -scales * (1 << (bits - 1)), bits, group)


def _method(variant: str, n: int, k: int, device: torch.device):
    """The linear method of variant for an [n, k] weight (random values)."""
    from gpu_worker.layers.fp8_linear import Fp8LinearMethod, fp8_w8a8_supported
    from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod

    if variant == "int4-g128":
        return IntTritonLinearMethod([_int_weight(4, 128, n, k, device)])
    if variant == "int8-channel":
        return IntTritonLinearMethod([_int_weight(8, -1, n, k, device)])
    if variant == "gguf-Q4_K":  # Q4_K's layout: groups of 32 with float offsets
        w = _int_weight(4, 32, n, k, device)
        return IntTritonLinearMethod([w._replace(offsets=-w.scales * 3.5)])
    dense = torch.empty(n, k, device=device).uniform_(-0.05, 0.05)
    w8a8 = variant == "fp8-w8a8"
    if w8a8 and not fp8_w8a8_supported(device):
        raise SystemExit(f"{variant}: no FP8 tensor cores on this device (cc < 8.9)")
    return Fp8LinearMethod([quantize_fp8(dense)], w8a8=w8a8, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rows", default="1,4,16,32,64,256")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    device = torch.device("cuda")
    layers, per_layer, head = SHAPES[args.shape]
    shapes = [(*s, layers) for s in per_layer] + [(*head, 1)]
    rows_list = [int(r) for r in args.rows.split(",")]
    bf16_ms: dict[int, float] = {}

    Call = tuple[str, Callable[[], object], int, int]  # label, launch, bytes read, per step

    def step(name: str, rows: int, calls: Sequence[Call]) -> None:
        total_us = total_bytes = 0.0
        parts = {}
        for label, fn, nbytes, count in calls:
            us = time_us(fn)
            parts[label] = round(us, 1)
            total_us += us * count
            total_bytes += nbytes * count
        ms = total_us / 1e3
        record = {
            "variant": name,
            "rows": rows,
            "step_ms": round(ms, 3),
            "GB": round(total_bytes / 1e9, 2),
            "TB_per_s": round(total_bytes / total_us / 1e6, 3),
            "us_per_call": parts,
        }
        if name == "bf16 cuBLAS":
            bf16_ms[rows] = ms
        elif rows in bf16_ms:
            record["ratio_to_bf16"] = round(ms / bf16_ms[rows], 3)
        print(json.dumps(record), flush=True)

    for rows in rows_list:
        calls: list[Call] = []
        for label, n, k, count in shapes:
            w = torch.empty(n, k, dtype=torch.bfloat16, device=device).uniform_(-0.05, 0.05)
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
            dense = functools.partial(torch.nn.functional.linear, x, w)
            calls.append((label, dense, n * k * 2, count))
        step("bf16 cuBLAS", rows, calls)
        del calls
    for variant in args.variants.split(","):
        methods = [
            (label, _method(variant, n, k, device), k, count) for label, n, k, count in shapes
        ]
        for rows in rows_list:
            calls = []
            for label, method, k, count in methods:
                x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
                fn = functools.partial(method.apply, None, x, None)
                calls.append((label, fn, method.nbytes(None), count))
            step(variant, rows, calls)
        del methods
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
