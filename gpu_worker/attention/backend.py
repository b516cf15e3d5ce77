"""The attention-backend contract: what the runner, the CUDA graphs and the attention layers ask
of a backend, and where each backend declares what it runs.

A step goes through a backend in two calls: the runner builds the step's metadata once
(build), then every attention layer hands it q, k, v and its own KV cache (forward). What a
backend runs (dtypes, head sizes, block sizes, attention features, KV-cache dtypes) is data in
config/attention.py's table, so that the configuration refuses a model no backend runs before
any process imports gpu_worker/; each backend class points to its entry (support), and
selection (select.py) asks that entry whether the class runs a configuration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

from gpu_worker.attention.metadata import DeviceBatch, StepBatch

if TYPE_CHECKING:
    from config.attention import AttentionSupport

# The backend's own per-step metadata (what build() returns and forward() reads).
Metadata = TypeVar("Metadata")


class AttentionBackend(ABC, Generic[Metadata]):
    """Mixed prefill/decode attention over a paged KV cache, one layer at a time.

    Subclasses declare, as class attributes, their name and their entry of the capability table
    (support: support.backend == name), whether build() needs the step's host arrays
    (plans_on_host), whether their kernels compile at a shape's first launch (compiles_kernels:
    the runner then warms every step shape up before serving), the context length from which
    forward() takes another kernel path that warm-up must also compile (warm_up_context_len; 0:
    none) and whether a decode step of theirs can be captured in a CUDA graph
    (supports_cuda_graphs).
    """

    name: ClassVar[str]
    support: ClassVar[AttentionSupport]
    plans_on_host: ClassVar[bool] = False
    compiles_kernels: ClassVar[bool] = False
    warm_up_context_len: ClassVar[int] = 0
    supports_cuda_graphs: ClassVar[bool] = False

    @staticmethod
    def available() -> bool:
        """Whether this machine can run the backend's code; selection skips it otherwise."""
        return True

    @staticmethod
    @abstractmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of one layer's KV cache tensor, keys and values both, in the layout
        forward() reads; the runner allocates one such tensor per layer."""

    @abstractmethod
    def build(
        self, step: StepBatch | None, device_batch: DeviceBatch, device: torch.device
    ) -> Metadata:
        """The step's metadata, built once before the forward pass and read by every layer.
        step: the step as host arrays, given only when plans_on_host (else None); device_batch:
        the same step on the device. Must not read the device from the host (no sync)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Metadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Write this step's k and v ([T, Hkv, D]) into kv_cache at the metadata's slots (a
        slot of -1 writes nothing), then attend q ([T, Hq, D], Hq a multiple of Hkv) causally
        to each request's whole context; returns [T, Hq, D].

        An fp8 cache (kv_cache.dtype float8_e4m3fn, --kv-cache-dtype fp8) stores k / k_scale
        and v / v_scale rounded to e4m3 (saturating at +-448), and attention reads them back
        as value * scale in fp32; the layer passes its scales only with such a cache.

        The layer's features, passed only where it has them (a backend whose support lacks one
        is never handed it: selection refuses the model first): sliding_window, a query at
        position p attends to keys at p - sliding_window + 1 .. p only; sinks [Hq], a logit per
        query head added to the softmax's denominator (exp(sink)) that attends to nothing;
        logits_soft_cap c, each scaled score s becomes c * tanh(s / c) before the softmax."""

    def graph_metadata(self, buffers: DeviceBatch, device: torch.device) -> Metadata:
        """The metadata a captured decode graph holds (asked only when supports_cuda_graphs):
        it must read the persistent buffers themselves, never copies, since the graph replays
        with new values written into them and nothing is rebuilt at replay. By default build()
        over the buffers, right for a backend whose build() keeps the device batch's tensors (as
        every backend here does); a backend whose metadata is not build() over the buffers
        (one that plans on the host or copies them) overrides it."""
        return self.build(None, buffers, device)

    def uses_split_decode(self, meta: DeviceBatch, num_kv_heads: int, device: torch.device) -> bool:
        """Whether forward() takes its split-context decode path for this batch, decided from
        host values only. A graph fixes the path it was captured with, so the graphs capture
        each decode size once per answer and replay the one whose answer matches the step."""
        return False
