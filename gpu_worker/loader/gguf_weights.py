"""Loading a model from its GGUF file with the linear weights kept quantized.

Every Linear whose checkpoint tensors are all of a type the kernels run takes their blocks,
packed in row order (the fused qkv and gate_up projections take several): for the C kernels on
the CPU (kernels.gguf_quant, packings cached beside the file), for the Triton ones on CUDA
(kernels.gguf_device, packed at load straight onto the device);
the token embedding looks its rows up in its packed table, which a tied output projection
shares. The rest (norms, tensors of other types) is dequantized to fp32 and loaded as from
safetensors.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from torch import nn

from config.gguf_convert import dense_tensor, hf_row_order, hf_tensor_name
from config.gguf_tensors import GGUFTensor, read_gguf_tensors
from gpu_worker.layers.linear import Embedding, Linear
from gpu_worker.layers.linear_method import EmbeddingMethod
from gpu_worker.layers.quant_linear import GGUFCpuLinearMethod, GGUFTritonLinearMethod
from gpu_worker.loader.packed_cache import PackedCache
from gpu_worker.models.weights import WeightLoadError
from gpu_worker.parallel.group import tp_world_size
from kernels.gguf_device import DEVICE_QUANT_TYPES, DeviceQuantWeight, pack_device
from kernels.gguf_quant import QUANT_TYPES, QuantizedWeight, pack
from kernels.int_device import GGUF_INT_TYPES, gguf_to_int

logger = logging.getLogger(__name__)

_EMBEDDING = "model.embed_tokens.weight"


def _checkpoint_rows(model: nn.Module, name: str) -> list[str]:
    """The checkpoint tensors that make up Linear `name`'s weight, in row order."""
    if name == "lm_head" and model.cfg.tie_word_embeddings:
        return [_EMBEDDING]
    parent, _, leaf = name.rpartition(".")
    shards = [s for s in model.stacked_shards if s.fused == leaf]
    if not shards:
        return [f"{name}.weight"]
    owner = model.get_submodule(parent)
    shards.sort(key=lambda s: owner.shard_slice(s.shard_id)[0])
    return [f"{parent}.{s.original}.weight" for s in shards]


def _packed(
    tensor: GGUFTensor, name: str, model: nn.Module, cache: PackedCache | None
) -> QuantizedWeight | DeviceQuantWeight:
    """The tensor packed for the CPU kernels (cache given) or for the device's (cache None)."""
    in_features, out_features = (int(d) for d in tensor.shape)
    if cache is not None and (data := cache.get(name)) is not None:
        return QuantizedWeight(tensor.tensor_type, data, out_features, in_features)
    cfg = model.cfg
    rows = hf_row_order(tensor.data, name, cfg.num_attention_heads, cfg.num_key_value_heads)
    if cache is None:
        device = next(model.parameters()).device
        return pack_device(tensor.tensor_type, rows, out_features, in_features, device)
    weight = pack(tensor.tensor_type, rows, out_features, in_features)
    cache.put(name, weight.data)
    return weight


def uses_c_kernels(model: nn.Module) -> bool:
    """Whether model's quantized weights are packed for the C kernels (a model on the CPU) or
    for the Triton ones (kernels/gguf_device.py's planes; tests run those on the CPU under
    TRITON_INTERPRET=1 by replacing this)."""
    return next(model.parameters()).device.type == "cpu"


def load_gguf_weights(model: nn.Module, gguf_path: Path) -> None:
    """Fill model from gguf_path, linear weights and the embedding quantized where a kernel runs
    their type."""
    if tp_world_size() > 1:
        raise WeightLoadError(
            "GGUF quantized weights are not split across tensor-parallel ranks; "
            "use --dtype float32 (dequantized weights) with tensor parallelism"
        )
    if not gguf_path.is_file():
        raise WeightLoadError(
            f"{gguf_path.parent}: no {gguf_path.name} to load quantized weights "
            f"from; load_format 'gguf' needs a GGUF model (a .gguf file or the "
            f"default model)"
        )
    tensors = {hf_tensor_name(t.name): t for t in read_gguf_tensors(gguf_path)}
    # One copy of a table the output projection shares.
    packed: dict[str, QuantizedWeight | DeviceQuantWeight] = {}
    c_kernels = uses_c_kernels(model)
    cache = PackedCache(gguf_path) if c_kernels else None
    kernel_types = QUANT_TYPES if c_kernels else DEVICE_QUANT_TYPES
    method = GGUFCpuLinearMethod if c_kernels else GGUFTritonLinearMethod
    int_methods: dict[tuple[str, ...], EmbeddingMethod] = {}

    def packed_tensor(name: str) -> QuantizedWeight | DeviceQuantWeight:
        if name not in packed:
            packed[name] = _packed(tensors[name], name, model, cache)
        return packed[name]

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            sources = _checkpoint_rows(model, name)
        elif isinstance(module, Embedding):
            sources = [f"{name}.weight"]
        else:
            continue
        if not all(s in tensors and tensors[s].tensor_type in kernel_types for s in sources):
            continue
        try:
            weights = [packed_tensor(s) for s in sources]
            if not c_kernels and all(tensors[s].tensor_type in GGUF_INT_TYPES for s in sources):
                # Q4_0/Q4_1/Q4_K/Q8_0 on CUDA: the int kernel (kernels/int_device.py)
                from gpu_worker.layers.int_triton_linear import IntTritonLinearMethod

                key = tuple(sources)  # a tied table and output projection: one copy
                if key not in int_methods:
                    int_parts = [gguf_to_int(w) for w in weights]  # type: ignore[arg-type]
                    int_methods[key] = IntTritonLinearMethod(int_parts)
                module.use_method(int_methods[key])
            else:
                module.use_method(method(weights))  # type: ignore[arg-type]
        except ValueError as e:
            raise WeightLoadError(f"{gguf_path}: {', '.join(sources)}: {e}") from None
    if cache is not None:
        cache.save()
    types = Counter(tensors[name].tensor_type.name for name in packed)
    dense = [name for name in tensors if name not in packed]
    logger.info(
        "%s: kept quantized: %s; %d tensors dequantized to fp32",
        gguf_path.name,
        ", ".join(f"{n} x{c}" for n, c in sorted(types.items())),
        len(dense),
    )
    heads = model.cfg.num_attention_heads, model.cfg.num_key_value_heads
    model.load_weights(
        (str(gguf_path), name, dense_tensor(tensors[name], name, *heads)) for name in dense
    )
