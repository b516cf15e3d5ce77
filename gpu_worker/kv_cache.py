"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from config.engine import EngineConfig
from config.kv_window import blocks_one_request_needs, freed_window
from config.model_arch import ModelArchConfig

# KV cache on CPU when kv_cache_memory is not given.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30

# The element type of an fp8 KV cache (--kv-cache-dtype fp8): e4m3, finite, saturating at 448.
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for CacheConfig.kv_cache_dtype: the model's dtype for auto,
    float8_e4m3fn for fp8 (one byte a value: twice the tokens of a 16-bit cache, four times
    fp32's, in the same memory)."""
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    assert kv_cache_dtype == "auto", f"unresolved kv_cache_dtype {kv_cache_dtype!r}"
    return model_dtype


def kv_block_bytes(
    arch: ModelArchConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """Bytes one block occupies across all layers on one rank (MLA: the whole latent vector on
    every rank)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return arch.kv_elements_per_token_per_rank(tensor_parallel_size) * block_size * elem


def kv_cache_num_blocks(
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    profile: Callable[[], int] | None = None,
    extra_block_bytes: int = 0,
) -> int:
    """Blocks that fit: num_gpu_blocks_override, else kv_cache_memory, else what the device allows
    beside the peak activation bytes that profile() measures (a dummy run of the largest step).
    dtype: the model's; a block's bytes are counted in the cache's own element type
    (kv_cache_torch_dtype). extra_block_bytes: what each block id costs beside the target's
    (a draft model's own KV in the same block ids: Proposer.kv_block_bytes())."""
    assert config.arch is not None
    cache = config.cache
    cache_dtype = kv_cache_torch_dtype(cache.kv_cache_dtype, dtype)
    per_block = (
        kv_block_bytes(
            config.arch, cache.block_size, cache_dtype, config.parallel.tensor_parallel_size
        )
        + extra_block_bytes
    )
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    elif cache.kv_cache_memory is not None:
        num_blocks = int(cache.kv_cache_memory) // per_block
    elif device.type == "cuda":
        assert profile is not None, "a CUDA KV cache is sized from a profile run"
        num_blocks = _cuda_free_bytes(config, device, profile()) // per_block
    else:
        num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // per_block
    # With a model-wide sliding window, blocks behind it are freed: a request holds at most the
    # window's and a step's blocks (config/kv_window.py), not all of max_model_len's.
    needed = blocks_one_request_needs(config)
    if num_blocks < needed:
        window = freed_window(config)
        held = f" (sliding window {window})" if window is not None else ""
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({num_blocks * per_block / 2**20:.1f} MiB), fewer than the {needed} blocks one "
            f"request of max_model_len {config.max_model_len}{held} needs; give it more memory "
            f"(kv_cache_memory / gpu_memory_utilization) or lower max_model_len"
        )
    return num_blocks


def _cuda_free_bytes(config: EngineConfig, device: torch.device, peak_activations: int) -> int:
    """What gpu_memory_utilization leaves for the KV cache once the weights, everything else
    already on the device, and the measured activation peak of the largest step are counted."""
    free, total = torch.cuda.mem_get_info(device)
    budget = total * config.cache.gpu_memory_utilization - (total - free)
    return max(0, int(budget - peak_activations))


def allocate_kv_caches(
    arch: ModelArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_shape: Callable[[int, int, int, int], tuple[int, ...]],
    tensor_parallel_size: int = 1,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, in the attention backend's layout (cache_shape); an
    MLA model's holds one latent vector of kv_latent_dim elements per token (asked of
    cache_shape as one KV head of that size: the MLA backend's layout)."""
    kv_heads, head_dim = arch.num_key_value_heads // tensor_parallel_size, arch.head_dim
    if arch.kv_latent_dim is not None:
        kv_heads, head_dim = 1, arch.kv_latent_dim
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim)
    if device.type == "cpu":
        return [_lazily_zeroed(shape, dtype) for _ in range(arch.num_hidden_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory, whose pages the OS zeroes when first touched:
    torch.zeros wrote the default 2 GiB cache at start-up (1-3 s here)."""
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=count).view(shape)
