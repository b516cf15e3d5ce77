"""The sliding window behind which the KV cache manager frees a request's blocks, and the blocks
one request then needs at most.

Only a model whose every attention layer attends within the same window W qualifies (Mistral
v0.1, Phi-3 with sliding_window): a query at position p reads keys p - W + 1 .. p in every
layer, so once a request has computed C tokens no later query reads a block wholly before
C - W + 1, and the engine core can give it back. A hybrid model (gpt-oss, Gemma 2/3: some
layers see the whole context) keeps every block: its full layers read them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from config.model_arch import ModelArchConfig

if TYPE_CHECKING:
    # Annotations only: config.draft_model, which config.engine imports, reads this module.
    from config.engine import EngineConfig


def model_wide_window(arch: ModelArchConfig | None, max_model_len: int) -> int | None:
    """The window every attention layer of the model attends within, when a sequence can
    outgrow it (W < max_model_len); None when any layer sees the whole context, the layers'
    windows differ, or no sequence is longer than the window (nothing would ever be freed)."""
    if arch is None or arch.sliding_window is None or arch.kv_latent_dim is not None:
        return None
    windows = {arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)}
    if len(windows) != 1:
        return None
    (window,) = windows
    return window if window is not None and window < max_model_len else None


def freed_window(config: EngineConfig) -> int | None:
    """model_wide_window of a resolved configuration (None before resolve())."""
    return model_wide_window(config.arch, config.max_model_len)


def blocks_one_request_needs(config: EngineConfig) -> int:
    """The most KV blocks one request holds in any step: every block of max_model_len tokens,
    or for a model-wide window W the blocks of a step's W - 1 + max_num_batched_tokens keys
    (the oldest window's and the step's own), plus one for the window's unaligned start."""
    block_size = config.cache.block_size
    whole = -(-config.max_model_len // block_size)
    window = freed_window(config)
    tokens = config.scheduler.max_num_batched_tokens
    if window is None or tokens is None:
        return whole
    return min(whole, -(-(window - 1 + tokens) // block_size) + 1)
