"""The LinearMethod that runs quantized weights on a device, and quantizing a model's dense
Linears at load (--quantization fp8 on a dense checkpoint; dummy weights with --quantization).

Int weights (GPTQ, AWQ, compressed-tensors int): the C kernels on the CPU (fp32 activations),
the Triton kernel on CUDA. FP8 weights: on CUDA the FP8 method (W8A8 where the device has FP8
tensor cores, compute capability 8.9 and above, else weight-only); on the CPU, where no kernel
computes in fp8, W dequantized into the layer's dense weight (the CPU's layouts then apply), so
results equal the dequantized model's.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

import torch
from torch import nn

from config.quantization import QuantScheme
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.linear_method import LinearMethod
from kernels.quant_weights import Fp8Weight, IntWeight, quantize_fp8, quantize_int


def int_method(parts: Sequence[IntWeight], device: torch.device) -> LinearMethod:
    """The method computing x @ W^T for W's rows given as int parts, in order, on device."""
    if device.type == "cpu":
        from gpu_worker.layers.int_cpu_linear import IntCpuLinearMethod

        return IntCpuLinearMethod(parts)
    if device.type == "cuda":
        from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod  # imports Triton

        return IntTritonLinearMethod([_to(p, device) for p in parts])
    raise ValueError(f"int quantized weights have no kernel on {device.type}")


def fp8_method(
    parts: Sequence[Fp8Weight],
    device: torch.device,
    w8a8: bool = True,
    dtype: torch.dtype | None = None,
) -> LinearMethod | None:
    """The method computing x @ W^T for W's rows given as fp8 parts on device: W8A8 where the
    device has FP8 tensor cores and w8a8 (False: a weight-only checkpoint, W8A16), else
    weight-only; None where no kernel computes in fp8 (the CPU): then W runs dequantized
    (use_fp8). dtype: the model's, which a weight-only W is dequantized to at once (without
    it, at the first step)."""
    if device.type != "cuda":
        return None
    from gpu_worker.layers.fp8_linear import Fp8LinearMethod, fp8_w8a8_supported

    parts = [
        Fp8Weight(
            p.weight.to(device),
            p.scale.to(device),
            None if p.input_scale is None else p.input_scale.to(device),
        )
        for p in parts
    ]
    return Fp8LinearMethod(parts, w8a8=w8a8 and fp8_w8a8_supported(device), dtype=dtype)


def use_fp8(layer: Linear, parts: Sequence[Fp8Weight], device: torch.device) -> None:
    """Give layer its fp8 W: the device's fp8 method, or where there is none, the dequantized W
    as its dense weight in the layer's dtype."""
    weight = layer.weight
    assert weight is not None, "a dense layer holds its weight until it takes another method"
    method = fp8_method(parts, device, dtype=weight.dtype)
    if method is not None:
        layer.use_method(method)
        return
    with torch.no_grad():
        weight.copy_(torch.cat([p.dequantize() for p in parts]))


def _to(part: IntWeight, device: torch.device) -> IntWeight:
    return part._replace(
        codes=part.codes.to(device),
        scales=part.scales.to(device),
        offsets=part.offsets.to(device),
        perm=None if part.perm is None else part.perm.to(device),
    )


def ignored(name: str, patterns: Sequence[str]) -> bool:
    """Whether module `name` matches one of a checkpoint's ignore patterns: 're:<regex>'
    (compressed-tensors), an fnmatch pattern (ModelOpt's exclude_modules), or a name or a
    name's last components (modules_to_not_convert: 'lm_head', 'mlp.gate')."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern) or fnmatch.fnmatch(name, pattern):
            return True
    return False


def quantize_model_linears(model: nn.Module, scheme: QuantScheme) -> int:
    """Quantize every loaded dense Linear of model round-to-nearest as scheme says (fp8 per
    output channel with dynamic activations, or int with scheme's bits and group size),
    skipping the output projection and the modules scheme ignores, as vLLM does; returns how
    many were quantized. The layers' weights must be loaded (or random) already."""
    device = next(model.parameters()).device
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.endswith("lm_head"):
            continue
        if module.weight is None or ignored(name, scheme.ignore):
            continue
        weight = module.weight.detach()
        if scheme.method == "fp8":
            use_fp8(module, [quantize_fp8(weight)], device)  # on the device: no copies
        else:
            group = scheme.group_size if scheme.group_size > 0 else weight.shape[1]
            if weight.shape[1] % group:
                group = weight.shape[1]  # one group per row where the size does not divide
            part = quantize_int(weight, scheme.bits, group)
            module.use_method(int_method([part], device))
        count += 1
    return count
