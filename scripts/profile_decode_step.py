"""Profile steady decode steps on a GPU with torch.profiler: kernels per step, host-to-device
copies per step, and the device's idle time between steps.

Runs an EngineCore in this process on a dummy-weight model of the shape `engine bench device`
uses (llama3-8b by default), lets a batch of requests reach steady decode, then records
--steps steps. Prints one JSON object; --trace also writes the Chrome trace.

    python scripts/profile_decode_step.py --batch 1 [--enforce-eager] [--trace t.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--trace", help="write the Chrome trace here")
    args = parser.parse_args()
    print(json.dumps(profile(args), indent=1))


def profile(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.device_shapes import write_model_dir
    from config.engine import engine_config_from_kwargs
    from engine_core.engine_core import EngineCore
    from protocol.engine_core import EngineCoreRequest
    from protocol.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        total = args.context_len + args.steps + 40
        config = engine_config_from_kwargs(
            model=str(write_model_dir(Path(tmp), args.shape)),
            load_format="dummy",
            max_model_len=total,
            max_num_seqs=max(args.batch, 1),
            num_gpu_blocks_override=args.batch * (-(-total // 16)) + 8,
            async_scheduling=not args.no_async,
            enforce_eager=args.enforce_eager,
        )
        core = EngineCore(config)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps + 30)
        vocab = config.arch.vocab_size
        for n in range(args.batch):
            ids = rng.integers(0, vocab, args.context_len).tolist()
            core.add_request(EngineCoreRequest(f"r{n}", ids, params))
        for _ in range(10):  # prefill and the first decodes
            core.step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                core.step()
            torch.cuda.synchronize()
        core.shutdown()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    copies = Counter(
        e.name.split(" ")[1] if " " in e.name else e.name for e in events if "Memcpy" in e.name
    )
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, idle, end = 0.0, 0.0, None
    for start, stop in spans:
        if end is not None and start > end:
            idle += start - end
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end = stop
    wall = spans[-1][1] - spans[0][0] if spans else 0.0
    names = Counter(e.name for e in kernels)
    time_of: Counter[str] = Counter()
    for e in kernels:
        time_of[e.name] += e.time_range.end - e.time_range.start
    return {
        "shape": args.shape,
        "batch": args.batch,
        "eager": args.enforce_eager,
        "async_scheduling": not args.no_async,
        "steps": args.steps,
        "kernels_per_step": round(len(kernels) / args.steps, 1),
        "copies_per_step": {k: round(v / args.steps, 2) for k, v in copies.items()},
        "device_busy_us_per_step": round(busy / args.steps, 1),
        "device_idle_us_per_step": round(idle / args.steps, 1),
        "wall_us_per_step": round(wall / args.steps, 1),
        # (name, launches per step, device us per step), the costliest first.
        "top_kernels": [
            (name[:80], round(names[name] / args.steps, 1), round(t / args.steps, 1))
            for name, t in time_of.most_common(20)
        ],
    }


if __name__ == "__main__":
    main()
