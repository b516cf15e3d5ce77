"""Quantized weights on a device against the dequantized dense model on the same device.

For each (quantization, dtype): a random Llama with the engine's dummy weights, quantized at load
(--quantization fp8|gptq|awq with --load-format dummy: round to nearest, as `engine bench device`
runs them), against the same dummy weights with every quantized Linear's W replaced by its
dequantization (the same quantizer, kernels/quant_weights.py, the same Linears), run
dense. Both through the model runner on the device: greedy tokens of a few prompts and each
step's top logprobs, compared while the two agree on the tokens so far. Prints one JSON object;
exit status 1 when a case exceeds its tolerance or fails.

    python scripts/device_quant_check.py                    # CUDA: fp8, gptq, awq in bf16 and fp32
    python scripts/device_quant_check.py --device cpu       # the same check of the CPU's methods
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

from config.quantization import QuantScheme
from gpu_worker.layers.linear import Linear
from gpu_worker.loader import model_loader
from gpu_worker.loader.quant_methods import ignored
from kernels.quant_weights import quantize_fp8, quantize_int
from protocol.sampling_params import SamplingParams
from tests.worker.runner_utils import make_runner

VOCAB = 8192
# A Llama big enough for every group size the kernels tile (K = 1024 and 2816, 128 | K) and a
# few tiles of rows, small enough to load in a second.
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
NEW_TOKENS, TOP = 16, 5
# Largest |logprob difference| allowed: fp32 weight-only computes what the dequantized model
# does up to summation order; bf16 within the CUDA tier's tolerance; fp8 W8A8 also rounds the
# activations to fp8 (per token), which the dequantized reference does not.
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.08, "w8a8": 0.25}


def dequantized_linears(model: nn.Module, scheme: QuantScheme) -> int:
    """quantize_model_linears' Linears and quantizers, each W replaced by its dequantization
    (kept dense): the reference model."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.endswith("lm_head"):
            continue
        if module.weight is None or ignored(name, scheme.ignore):
            continue
        weight = module.weight.detach()
        if scheme.method == "fp8":
            deq = quantize_fp8(weight).dequantize()
        else:
            group = scheme.group_size if scheme.group_size > 0 else weight.shape[1]
            if weight.shape[1] % group:
                group = weight.shape[1]
            deq = quantize_int(weight, scheme.bits, group).dequantize()
        with torch.no_grad():
            module.weight.copy_(deq)
        count += 1
    return count


@contextmanager
def reference_loading() -> Iterator[None]:
    """While it lasts, loading with --quantization keeps the Linears dense and dequantized."""
    real = model_loader.quantize_model_linears
    model_loader.quantize_model_linears = dequantized_linears
    try:
        yield
    finally:
        model_loader.quantize_model_linears = real


def generate(model_dir: Path, device: str, dtype: str, quantization: str, prompts, reference):
    """Greedy tokens and each step's top logprobs, and the Linears' method names."""
    args = dict(
        device=device,
        dtype=dtype,
        load_format="dummy",
        quantization=quantization,
        max_model_len=128,
        enforce_eager=True,
    )
    if reference:
        with reference_loading():
            runner, driver = make_runner(model_dir, **args)
    else:
        runner, driver = make_runner(model_dir, **args)
    assert runner.model is not None
    methods = sorted(
        {
            type(m.method).__name__
            for n, m in runner.model.named_modules()
            if isinstance(m, Linear) and not n.endswith("lm_head")
        }
    )
    tokens = driver.run(
        prompts, SamplingParams(temperature=0.0, ignore_eos=True, logprobs=TOP), NEW_TOKENS
    )
    logprobs = {
        r: [sorted(lp.logprobs[0][1:], reverse=True) for lp in driver.logprobs[r]] for r in prompts
    }
    del runner, driver
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens, logprobs, methods


def check_case(model_dir: Path, device: str, dtype: str, quantization: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    prompts = {
        f"p{i}": torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        for i, n in enumerate((5, 11, 17, 32))
    }
    began = time.perf_counter()
    got, got_lp, methods = generate(model_dir, device, dtype, quantization, prompts, False)
    ref, ref_lp, ref_methods = generate(model_dir, device, dtype, quantization, prompts, True)
    worst, agreeing = 0.0, 0
    for r in prompts:
        for step in range(NEW_TOKENS):
            # Same context: the tokens before this step agree.
            if got[r][:step] != ref[r][:step]:
                break
            agreeing += 1
            diff = max(abs(a - b) for a, b in zip(got_lp[r][step], ref_lp[r][step]))
            worst = max(worst, diff)
    w8a8 = "Fp8LinearMethod" in methods and device == "cuda" and _w8a8(device)
    tolerance = TOLERANCE["w8a8" if w8a8 else dtype]
    tokens_equal = got == ref
    ok = worst <= tolerance and (tokens_equal or dtype != "float32")
    return {
        "quantization": quantization,
        "dtype": dtype,
        "methods": methods,
        "reference_methods": ref_methods,
        "w8a8": w8a8,
        "tokens_equal": tokens_equal,
        "steps_compared": agreeing,
        "steps": NEW_TOKENS * len(prompts),
        "max_logprob_diff": round(worst, 5),
        "tolerance": tolerance,
        "ok": ok,
        "seconds": round(time.perf_counter() - began, 1),
    }


def _w8a8(device: str) -> bool:
    from gpu_worker.layers.fp8_linear import fp8_w8a8_supported

    return fp8_w8a8_supported(torch.device(device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quantizations", default="fp8,gptq,awq")
    parser.add_argument(
        "--dtypes",
        help="default: bfloat16,float32 on CUDA, float32 on the CPU (int weights "
        "run there with float32 activations)",
    )
    args = parser.parse_args()
    dtypes = (args.dtypes or ("bfloat16,float32" if args.device == "cuda" else "float32")).split(
        ","
    )
    cases = []
    with tempfile.TemporaryDirectory(prefix="device-quant-check-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        for quantization in args.quantizations.split(","):
            for dtype in dtypes:
                try:
                    cases.append(check_case(Path(tmp), args.device, dtype, quantization))
                except Exception as exc:  # one failing case must not hide the others' figures
                    cases.append(
                        {
                            "quantization": quantization,
                            "dtype": dtype,
                            "ok": False,
                            "error": repr(exc),
                        }
                    )
                print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({"device": device_name, "cases": cases}, indent=2))
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
