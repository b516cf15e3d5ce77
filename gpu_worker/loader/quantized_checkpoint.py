"""Loading a GPTQ, AWQ or FP8 (compressed-tensors, ModelOpt, FBGEMM, vLLM's fp8) safetensors
checkpoint with its linear weights kept quantized.

Every Linear whose checkpoint tensors are quantized (a fused qkv or gate_up projection: each
of its checkpoint projections, in row order, as gguf_weights.py gathers them) becomes IntWeight
or Fp8Weight parts (kernels/quant_weights.py), given to the device's method
(quant_methods.py). A Linear the checkpoint keeps dense (ignored modules, lm_head), the norms
and the embedding load through model.load_weights as from a dense checkpoint; so do fp8 weights
on the CPU, dequantized. A checkpoint's k_scale/v_scale set its Attention modules' scales.

Packings read (the inverse of what each quantizer writes):
- GPTQ: qweight int32 [K * bits / 32, N], codes packed along K, the lowest bits first; qzeros
  int32 [K / g, N * bits / 32] packed along N, stored minus one in checkpoint_format "gptq"
  (v1); scales fp16 [K / g, N]; g_idx int32 [K], the group of each input (act-order).
  W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]).
- AWQ (GEMM): qweight int32 [K, N / 8] packed along N in the order 0 2 4 6 1 3 5 7; qzeros
  int32 [K / g, N / 8] likewise; scales fp16 [K / g, N]; W = (q - z) * s.
- compressed-tensors pack-quantized: weight_packed int32 [N, K * bits / 32] packed along K,
  codes offset by 2**(bits - 1) (symmetric); weight_scale [N, K / g]; W = s * (q - 2**(bits-1));
  weight_g_idx [K] with actorder "group", as GPTQ's g_idx.
- FP8: weight float8_e4m3fn [N, K], weight_scale per tensor or per row, input_scale (static).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from config.quantization import QuantScheme
from gpu_worker.layers.attention import Attention
from gpu_worker.layers.linear import Linear
from gpu_worker.loader.quant_methods import fp8_method, int_method
from gpu_worker.models.weights import StackedShard, WeightLoadError
from gpu_worker.parallel.group import tp_world_size
from kernels.quant_weights import Fp8Weight, IntWeight

logger = logging.getLogger(__name__)

_AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)  # column r of a packed int32 is its nibble _AWQ_UNPACK[r]
# k_scale/v_scale as compressed-tensors (self_attn.k_scale, k_proj.output_scale) and ModelOpt
# (k_proj.k_scale) name them.
_KV_SCALE = re.compile(
    r"^(?P<attn>.*?)\.(?:(?P<a>[kv])_scale|(?P<b>[kv])_proj\.(?:[kv]|output)_scale)$"
)


class _Checkpoint:
    """The tensors of a safetensors checkpoint by name, read on demand."""

    def __init__(self, files: list[Path], stack: ExitStack, device: torch.device) -> None:
        self.device = device  # where get() puts the quantized tensors (unpacked there)
        self.handles: dict[str, object] = {}
        self.file: dict[str, str] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except (OSError, ValueError, SafetensorError) as e:
                raise WeightLoadError(f"{path}: cannot read safetensors file ({e})") from None
            for name in handle.keys():
                self.handles[name], self.file[name] = handle, str(path)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def get(self, name: str) -> torch.Tensor:
        """The tensor, marked as read (not passed on to model.load_weights)."""
        if name not in self.handles:
            raise ValueError(f"tensor {name!r} is missing")
        self.used.add(name)
        return self.handles[name].get_tensor(name).to(self.device)  # type: ignore[attr-defined]

    def discard(self, name: str) -> None:
        """Mark a tensor the engine does not need as read, where the checkpoint has it."""
        if name in self.handles:
            self.used.add(name)

    def rest(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        for name, handle in self.handles.items():
            if name not in self.used:
                yield self.file[name], name, handle.get_tensor(name)  # type: ignore[attr-defined]


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] of 32 / bits codes each, lowest bits first -> uint8 [R * 32 / bits, C]."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32, device=packed.device) * bits).view(1, per, 1)
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C * 32 / bits], each int32's codes lowest bits first."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _int_weight(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, g_idx: torch.Tensor
) -> IntWeight:
    """IntWeight of W[n, k] = scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n]), from q
    [K, N] codes, zeros and scales [groups, N], g_idx [K]; act-order groups made contiguous."""
    k = q.shape[0]
    groups = scales.shape[0]
    if k % groups:
        raise ValueError(f"{k} inputs do not split into {groups} groups")
    group_size = k // groups
    contiguous = torch.arange(k, device=q.device) // group_size
    perm: torch.Tensor | None = None
    if not torch.equal(g_idx, contiguous):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(
                f"g_idx does not give each of the {groups} groups {group_size} inputs "
                f"(act-order groups must each be group_size long)"
            )
        q = q[perm]
    s = scales.to(torch.float32).t().contiguous()
    return IntWeight(
        q.t().contiguous(),
        s,
        (-s * zeros.to(torch.float32).t()).contiguous(),
        bits,
        group_size,
        perm,
    )


def _gptq(ckpt: _Checkpoint, prefix: str, scheme: QuantScheme) -> IntWeight:
    bits = scheme.bits
    q = _unpack_rows(ckpt.get(f"{prefix}.qweight"), bits)
    scales = ckpt.get(f"{prefix}.scales")
    n = scales.shape[1]
    zeros = _unpack_columns(ckpt.get(f"{prefix}.qzeros"), bits)[:, :n].to(torch.int32)
    if scheme.checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores z - 1 (as GPTQ's CUDA kernels read it, without a wrap)
    k = q.shape[0]
    g_idx = (
        ckpt.get(f"{prefix}.g_idx").to(torch.int64)
        if f"{prefix}.g_idx" in ckpt
        else torch.arange(k, device=q.device) // (k // scales.shape[0])
    )
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, not [{k}]")
    return _int_weight(q, zeros, scales, bits, g_idx)


def _awq(ckpt: _Checkpoint, prefix: str, scheme: QuantScheme) -> IntWeight:
    order = list(_AWQ_UNPACK)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        codes = _unpack_columns(t, 4)
        return codes.view(t.shape[0], -1, 8)[:, :, order].reshape(t.shape[0], -1)

    q = unpack(ckpt.get(f"{prefix}.qweight"))
    zeros = unpack(ckpt.get(f"{prefix}.qzeros"))
    scales = ckpt.get(f"{prefix}.scales")
    g_idx = torch.arange(q.shape[0], device=q.device) // (q.shape[0] // scales.shape[0])
    return _int_weight(q, zeros, scales, 4, g_idx)


def _packed_int(ckpt: _Checkpoint, prefix: str, scheme: QuantScheme) -> IntWeight:
    bits = scheme.bits
    ckpt.discard(f"{prefix}.weight_shape")  # [N, K]: the unpadded shape, the module's
    q = _unpack_columns(ckpt.get(f"{prefix}.weight_packed"), bits)  # [N, K]
    scales = ckpt.get(f"{prefix}.weight_scale").to(torch.float32)  # [N, groups]
    zeros = torch.full_like(scales, float(1 << (bits - 1))).t()
    k = q.shape[1]
    g_idx = (
        ckpt.get(f"{prefix}.weight_g_idx").to(torch.int64)  # actorder "group"
        if f"{prefix}.weight_g_idx" in ckpt
        else torch.arange(k, device=q.device) // (k // scales.shape[1])
    )
    if g_idx.shape != (k,):
        raise ValueError(f"weight_g_idx has shape {tuple(g_idx.shape)}, not [{k}]")
    return _int_weight(q.t(), zeros, scales.t(), bits, g_idx)


def _fp8(ckpt: _Checkpoint, prefix: str, scheme: QuantScheme) -> Fp8Weight:
    weight = ckpt.get(f"{prefix}.weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn")
    n = weight.shape[0]
    scale = ckpt.get(f"{prefix}.weight_scale").to(torch.float32).reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n).contiguous()
    elif scale.numel() != n:
        raise ValueError(f"weight_scale has {scale.numel()} values, not 1 or one per row ({n})")
    if scheme.activation_dynamic:
        ckpt.discard(f"{prefix}.input_scale")  # activations are scaled per token instead
        return Fp8Weight(weight, scale, None)
    if f"{prefix}.input_scale" not in ckpt:
        raise ValueError(f"{prefix}.input_scale is missing (static activation scales)")
    input_scale = ckpt.get(f"{prefix}.input_scale").to(torch.float32).reshape(-1).max()
    return Fp8Weight(weight, scale, input_scale)


def _is_quantized(ckpt: _Checkpoint, prefix: str, scheme: QuantScheme) -> bool:
    if scheme.method == "fp8":
        return f"{prefix}.weight_scale" in ckpt
    marker = "weight_packed" if scheme.source == "compressed-tensors" else "qweight"
    return f"{prefix}.{marker}" in ckpt


_READERS: dict[str, Callable[[_Checkpoint, str, QuantScheme], IntWeight]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _packed_int,
}


def _prefixes(model: nn.Module, name: str) -> list[str]:
    """The checkpoint modules whose weights make up Linear `name`'s, in row order."""
    parent, _, leaf = name.rpartition(".")
    stacked: Iterable[StackedShard] = getattr(model, "stacked_shards", ())
    shards = [s for s in stacked if s.fused == leaf]
    if not shards:
        return [name]
    owner: Any = model.get_submodule(parent)
    shards.sort(key=lambda s: owner.shard_slice(s.shard_id)[0])
    return [f"{parent}.{s.original}" for s in shards]


def load_quantized_checkpoint(
    model: nn.Module, files: list[Path], scheme: QuantScheme, device: torch.device
) -> None:
    """Fill model from the safetensors files, the Linears the checkpoint quantizes as scheme
    says kept quantized (fp8 on the CPU: dequantized into the model's dtype)."""
    kept = scheme.method == "int" or device.type == "cuda"
    if kept and tp_world_size() > 1:
        raise WeightLoadError(
            f"{scheme.source} quantized weights are not split across tensor-parallel ranks yet"
        )
    decoder: Any = model  # a model class of gpu_worker/models (cfg, load_weights)
    with ExitStack() as stack:
        # Unpacked where they run: on a GPU the unpacking is a few device ops per tensor.
        ckpt = _Checkpoint(files, stack, device if kept else torch.device("cpu"))
        # fp8 weights the CPU loads dequantized, by checkpoint name: dequantized one at a time
        # as model.load_weights reads them (a quarter of the fp32 weights' memory meanwhile).
        dense: dict[str, tuple[Fp8Weight, torch.dtype]] = {}
        quantized = 0
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.weight is None:
                continue
            if name == "lm_head" and decoder.cfg.tie_word_embeddings:
                continue
            prefixes = _prefixes(model, name)
            marked = [_is_quantized(ckpt, p, scheme) for p in prefixes]
            if not any(marked):
                continue  # kept dense by the checkpoint
            try:
                if not all(marked):
                    raise ValueError(
                        f"{', '.join(p for p, m in zip(prefixes, marked) if not m)} not "
                        f"quantized beside {', '.join(p for p, m in zip(prefixes, marked) if m)}"
                    )
                if scheme.method == "int":
                    ints = [_READERS[scheme.source](ckpt, p, scheme) for p in prefixes]
                    module.use_method(int_method(ints, device))
                else:
                    fp8s = [_fp8(ckpt, p, scheme) for p in prefixes]
                    method = fp8_method(
                        fp8s, device, w8a8=not scheme.weight_only, dtype=module.weight.dtype
                    )
                    if method is not None:
                        module.use_method(method)
                    else:
                        for p, part in zip(prefixes, fp8s):
                            dense[f"{p}.weight"] = part, module.weight.dtype
                            ckpt.used.discard(f"{p}.weight")  # loaded dense, dequantized
            except (ValueError, RuntimeError) as e:
                source = next(
                    (f for n, f in ckpt.file.items() if n.startswith(prefixes[0] + ".")), "?"
                )
                raise WeightLoadError(f"{source}: {name} ({', '.join(prefixes)}): {e}") from None
            quantized += 1
        _set_kv_scales(model, ckpt)
        logger.info(
            "%s checkpoint: %d linear layers %s",
            scheme.source,
            quantized,
            "kept quantized" if kept else "dequantized from fp8",
        )
        decoder.load_weights(
            (file, name, _dequantized(*dense[name]) if name in dense else tensor)
            for file, name, tensor in ckpt.rest()
        )


def _dequantized(part: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    return part.dequantize().to(dtype)


def _set_kv_scales(model: nn.Module, ckpt: _Checkpoint) -> None:
    """The Attention modules' k_scale/v_scale from the checkpoint's tensors that name them."""
    for name in list(ckpt.handles):
        match = _KV_SCALE.match(name)
        attn = None if match is None else _attention_under(model, match["attn"])
        if match is None or attn is None:
            continue
        value = float(ckpt.get(name).to(torch.float32).max())
        setattr(attn, f"{match['a'] or match['b']}_scale", value)


def _attention_under(model: nn.Module, prefix: str) -> Attention | None:
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    return next((m for m in module.modules() if isinstance(m, Attention)), None)
