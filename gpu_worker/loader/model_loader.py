"""Build the engine's model class for a directory and fill its weights."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from config.gguf_convert import GGUF_LINK
from config.model_arch import ModelArchConfig
from config.quantization import quant_scheme
from gpu_worker.loader.cpu_layout import process_weights_after_loading
from gpu_worker.loader.gguf_weights import load_gguf_weights
from gpu_worker.loader.quant_methods import quantize_model_linears
from gpu_worker.loader.quantized_checkpoint import load_quantized_checkpoint
from gpu_worker.models.registry import model_class
from gpu_worker.models.weights import WeightLoadError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a resolved dtype name."""
    return _DTYPES[name]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index if present, else *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise WeightLoadError(f"{index}: lists shard {f.name}, which is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors weights in the model directory")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor, read through a memory map."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield str(path), name, f.get_tensor(name)
        except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a corrupt header
            if isinstance(e, WeightLoadError):
                raise
            raise WeightLoadError(f"{path}: cannot read safetensors file ({e})") from None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    """The model with weights from model_dir, or random weights when load_format is 'dummy';
    with 'gguf' the linear weights stay quantized as in the GGUF file model_dir links (the C
    kernels on the CPU, the Triton ones on CUDA). quantization (ModelConfig.quantization,
    resolved): the linear weights of a GPTQ, AWQ or FP8 checkpoint stay quantized, and dense
    or dummy ones are quantized at load (config/quantization.py's quant_scheme)."""
    began = time.perf_counter()
    scheme = quant_scheme(arch.hf_config, quantization, load_format)
    cls = model_class(arch.architecture, source=str(Path(model_dir) / "config.json"))
    if load_format == "gguf" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"GGUF quantized weights have no kernels on {device.type}")
    if load_format == "gguf" and device.type == "cpu" and dtype != torch.float32:
        raise ValueError(
            f"GGUF quantized weights run on the CPU with float32 activations, not "
            f"{dtype}; dequantize them with --dtype"
        )
    with _default_dtype(dtype), torch.device(device):
        model = cls(arch)
    if load_format == "dummy":
        _fill_dummy(model, seed, device)
    elif load_format == "gguf":
        load_gguf_weights(model, Path(model_dir) / GGUF_LINK)
    elif scheme is not None and not scheme.quantize_at_load:
        load_quantized_checkpoint(model, safetensors_files(model_dir), scheme, device)
    else:
        model.load_weights(iter_safetensors(model_dir))
    if scheme is not None and scheme.quantize_at_load:
        quantize_model_linears(model, scheme)
    process_weights_after_loading(model, device, torch.get_num_threads())
    logger.info(
        "model loaded in %.2f s (load format %s, %s on %s)",
        time.perf_counter() - began,
        load_format,
        str(dtype).removeprefix("torch."),
        device.type,
    )
    return model.eval()


def _fill_dummy(model: nn.Module, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.05, 0.05, generator=gen)
