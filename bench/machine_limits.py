"""This machine's limits that bound LLM speed: fp32 matmul GFLOP/s, memory read and copy
bandwidth; and the machine's description that every benchmark prints beside its figures.

`python -m bench.machine_limits` prints them.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any


def machine_info() -> dict[str, Any]:
    """CPU model and the vector extensions the CPU kernels use, cores, torch threads, device."""
    import torch

    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags_line = next(line for line in lines if line.startswith("flags"))
        flags = set(flags_line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    # The vector extensions the CPU kernels are built for (-march=native).
    vector = [
        f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile") if f in flags
    ]
    return {
        "cpu": cpu,
        "cpu_flags": vector,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_rates(n: int = 1024) -> dict[str, float]:
    """fp32 GFLOP/s of an n x n x n matrix multiply through torch and, on CPU, through the
    engine's own kernel (kernels/cpu/linear.c, twice torch's on AVX-512 AMD CPUs, where MKL runs
    AVX2 code); "limit" is the faster, so a fraction of it never flatters the engine."""
    import torch

    from kernels import cpu_binding
    from kernels import linear as cpu_linear

    a, b = torch.randn(n, n), torch.randn(n, n)
    rates = {"torch": 2 * n**3 / min(timed(lambda: a @ b) for _ in range(10)) / 1e9}
    if not torch.cuda.is_available() and cpu_binding.available():
        blocked = cpu_linear.block_weight(b)
        cpu_linear.linear(a, blocked)
        rates["engine_kernel"] = (
            2 * n**3 / min(timed(lambda: cpu_linear.linear(a, blocked)) for _ in range(10)) / 1e9
        )
    rates["limit"] = max(rates.values())
    return {k: round(v, 1) for k, v in rates.items()}


def memory_read_gbps(mbytes: int = 512, repeats: int = 5) -> float:
    """Best GB/s of reading a large fp32 buffer (the single-stream decode ceiling)."""
    import torch

    x = torch.ones(mbytes * 2**20 // 4)
    x.sum()
    return x.numel() * 4 / min(timed(x.sum) for _ in range(repeats)) / 1e9


def copy_bandwidth(device_type: str, nbytes: int, reps: int = 5) -> float:
    """Bytes/s of the best of reps copies of an nbytes tensor on the device (read + write)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device_type)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):  # the first copy faults the destination's pages in
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    if device_type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best


if __name__ == "__main__":
    print(machine_info())
    print(
        f"fp32 matmul: {matmul_rates()['limit']:.1f} GFLOP/s; "
        f"memory read: {memory_read_gbps():.1f} GB/s"
    )
