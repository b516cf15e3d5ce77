"""Measures this machine's limits that bound LLM speed: fp32 matmul GFLOP/s and memory read GB/s."""

from __future__ import annotations

import os
import platform
import time

import torch


def machine_info() -> dict[str, object]:
    """CPU model, cores, torch threads, device."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device, "torch": torch.__version__}


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(n: int = 1024) -> float:
    """Best fp32 GFLOP/s of an n x n x n matrix multiply (the batched-throughput ceiling): the
    faster of torch's matmul and, on CPU, the engine's own kernel, as `engine bench` measures it."""
    from frontend.bench import matmul_rates

    return matmul_rates(n)["limit"]


def memory_read_gbps(mbytes: int = 512, repeats: int = 5) -> float:
    """Best GB/s of reading a large fp32 buffer (the single-stream decode ceiling)."""
    x = torch.ones(mbytes * 2**20 // 4)
    return x.numel() * 4 / _best_time(lambda: x.sum(), repeats) / 1e9


if __name__ == "__main__":
    print(machine_info())
    print(f"fp32 matmul: {matmul_gflops():.1f} GFLOP/s; memory read: {memory_read_gbps():.1f} GB/s")
