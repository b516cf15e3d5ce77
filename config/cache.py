"""CacheConfig: the paged KV cache's shape, size and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError
from config.sizes import parse_size

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
HASH_ALGOS = ("sha256", "xxhash", "builtin")
# --kv-cache-dtype: auto keeps the model's dtype; fp8 (or its full name fp8_e4m3) keeps keys and
# values in float8_e4m3fn, each divided by its layer's scale (Attention.k_scale / v_scale).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache shape and prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" or "fp8" (fp8_e4m3 is read as fp8)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError(
                "kv_cache_dtype fp8_e5m2 is not supported: the fp8 KV cache is e4m3 "
                "(kv_cache_dtype fp8 or fp8_e4m3), whose scales come from the checkpoint"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as e:
                raise ConfigError(f"kv_cache_memory: {e}") from None
            if self.kv_cache_memory <= 0:
                raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be at least 1")
