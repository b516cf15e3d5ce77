"""Time the n-gram proposer (gpu_worker/spec_decode/ngram.py) on the CPU (the C kernel) or CUDA
(the Triton kernel), and the torch-op reference beside it.

    python scripts/bench_ngram.py [--device cpu] [--requests 1,64] [--lengths 2048,8192]

Rows of "text" draw tokens from a Zipf law over 32k ids (frequent tokens recur, as words do, so
many positions pass the first compare); "uniform" rows almost never do. Per case: the whole
propose() (the counts' copy, the kernel, the result) in microseconds (best of 5 runs), per
step and per request, with the thread count.
Prints JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch

from config.speculative import SpeculativeConfig
from gpu_worker.request_state import RequestStates
from gpu_worker.spec_decode.ngram import NgramProposer
from gpu_worker.spec_decode.proposer import ProposeInputs
from gpu_worker.staging import HostToDevice
from kernels.ngram import ngram_propose_torch


def _rows(kind: str, num: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if kind == "text":
        ids = (rng.zipf(1.2, size=(num, length)) - 1) % 32000
    else:
        ids = rng.integers(0, 32000, size=(num, length))
    return ids.tolist()


def _time_us(fn, device: torch.device, iters: int, batches: int = 5) -> float:
    """Microseconds per call: the best of batches runs of iters calls (noise only adds)."""
    fn()
    best = float("inf")
    for _ in range(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", default="1,64")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--kinds", default="text,uniform")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--lookup", default="2,5", help="prompt_lookup_min,max")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    lo, hi = (int(x) for x in args.lookup.split(","))
    spec = SpeculativeConfig("ngram", args.k, lo, hi)
    for length in (int(x) for x in args.lengths.split(",")):
        for num in (int(x) for x in args.requests.split(",")):
            for kind in args.kinds.split(","):
                max_model_len = length + 64
                states = RequestStates(num, max_model_len, 16, device, HostToDevice(device))
                rows = _rows(kind, num, length, seed=num + length)
                slots = [states.add(f"r{i}", r, len(r), [], 0) for i, r in enumerate(rows)]
                states.apply_staged_writes()
                slots_np = np.array(slots, dtype=np.int64)
                inputs = ProposeInputs(
                    slots_np=slots_np,
                    slots=torch.from_numpy(slots_np).to(device),
                    num_tokens_np=np.full(num, length, dtype=np.int64),
                    max_drafts_np=np.full(num, args.k, dtype=np.int64),
                    states=states,
                )
                proposer = NgramProposer(spec, max_model_len, device)
                found = int((proposer.propose(inputs)[:, 0] >= 0).sum())
                us = _time_us(functools.partial(proposer.propose, inputs), device, args.iters)
                counts = torch.full((num,), length, dtype=torch.int64, device=device)
                out = torch.empty((num, args.k), dtype=torch.int64, device=device)
                reference = functools.partial(
                    ngram_propose_torch, states.token_ids, inputs.slots, counts, counts, lo, hi, out
                )
                ref_us = _time_us(reference, device, max(args.iters // 20, 2))
                print(
                    json.dumps(
                        {
                            "device": str(device),
                            "requests": num,
                            "length": length,
                            "kind": kind,
                            "with_drafts": found,
                            "propose_us": round(us, 1),
                            "per_request_us": round(us / num, 2),
                            "torch_reference_us": round(ref_us, 1),
                            "threads": torch.get_num_threads(),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
