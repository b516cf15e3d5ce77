"""The weight bytes a decode step of a mixture-of-experts model really reads, for `engine bench
device`: every weight outside the experts once (attention, norms, routers, dense layers, the
output projection; the embedding table only one row per request: left out unless tied to the
output projection), and of each MoE layer only the experts the step's tokens were routed to.

The experts a step hits are counted from the step's routing where the bench can see the model
(ExpertCounter: forward hooks on the FusedMoE layers of an in-process, eager engine, in an
untimed run); otherwise they are estimated for uniform routing: a batch of B tokens, each
choosing k of E experts, hits E * (1 - (1 - k/E)^B) distinct experts on average.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from config.model_arch import ModelArchConfig
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.moe_routing import select_experts
from gpu_worker.models.registry import model_class


@dataclass(frozen=True, slots=True)
class MoELayerShape:
    """One MoE layer as a decode step reads it."""

    num_experts: int
    top_k: int
    bytes_per_expert: int

    def expected_hit(self, tokens: int) -> float:
        """Distinct experts tokens hit on average when each picks top_k uniformly at random."""
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclass(frozen=True, slots=True)
class MoEStepBytes:
    """What a decode step reads: other_bytes always, and per MoE layer its hit experts."""

    other_bytes: int
    layers: tuple[MoELayerShape, ...]

    @property
    def all_experts_bytes(self) -> int:
        return sum(layer.num_experts * layer.bytes_per_expert for layer in self.layers)

    def summary(self) -> dict[str, Any]:
        """The shape as the bench's figures give it (the first MoE layer's experts)."""
        first = self.layers[0]
        return {
            "moe_layers": len(self.layers),
            "experts": first.num_experts,
            "top_k": first.top_k,
            "bytes_per_expert": first.bytes_per_expert,
            "other_weight_bytes": self.other_bytes,
            "all_experts_bytes": self.all_experts_bytes,
        }

    def expected_hit(self, tokens: int) -> list[float]:
        """Each layer's distinct experts under uniform routing for a step of tokens."""
        return [layer.expected_hit(tokens) for layer in self.layers]

    def weight_bytes(self, experts_hit: list[float]) -> int:
        """Bytes of weights a step reads when layer i hits experts_hit[i] experts."""
        if len(experts_hit) != len(self.layers):
            raise ValueError(f"{len(experts_hit)} counts for {len(self.layers)} MoE layers")
        experts = sum(hit * layer.bytes_per_expert for hit, layer in zip(experts_hit, self.layers))
        return int(self.other_bytes + experts)


def moe_step_bytes(arch: ModelArchConfig, dtype_bytes: int) -> MoEStepBytes | None:
    """The model's step bytes (one rank holding everything), or None when it has no MoE layer.
    The model is built on the meta device: its parameters' shapes, no memory."""
    with torch.device("meta"):
        model = model_class(arch.architecture)(arch)
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not moe:
        return None
    expert_params = {id(p) for m in moe for p in m.parameters()}
    embedding = model.get_submodule("model.embed_tokens")
    tied = arch.tie_word_embeddings
    skip = expert_params | (set() if tied else {id(p) for p in embedding.parameters()})
    other = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    layers = tuple(
        MoELayerShape(
            m.num_experts,
            m.routing.top_k,
            sum(p[0].numel() for p in m.parameters()) * dtype_bytes,
        )
        for m in moe
    )
    return MoEStepBytes(other * dtype_bytes, layers)


def engine_model(core: Any) -> nn.Module | None:
    """The model of an EngineCore whose worker runs in this process (else None)."""
    worker = getattr(core.executor, "worker", None)
    runner = getattr(worker, "runner", None)
    return getattr(runner, "model", None)


class ExpertCounter:
    """Counts, per MoE layer, the distinct experts each forward's tokens are routed to, by
    recomputing the routing from the router logits the layer is handed (a host read per layer:
    for untimed runs only). Hooks fire only where the model runs eagerly (not in a replayed
    CUDA graph)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        # tokens in the forward -> per layer, the distinct counts seen
        self.seen: dict[int, list[list[int]]] = defaultdict(lambda: [[] for _ in self.layers])

    @contextmanager
    def counting(self) -> Iterator[ExpertCounter]:
        handles = [
            layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int):
        def hook(module: FusedMoE, args: tuple, kwargs: dict) -> None:
            logits = args[1] if len(args) > 1 else kwargs["router_logits"]
            bias = args[2] if len(args) > 2 else kwargs.get("correction_bias")
            _, ids = select_experts(logits, module.routing, bias)
            self.seen[logits.shape[0]][index].append(int(ids.unique().numel()))

        return hook

    def mean_hit(self, tokens: int) -> list[float] | None:
        """Per layer, the mean distinct experts of the forwards of exactly tokens tokens; None
        when no such forward was seen."""
        per_layer = self.seen.get(tokens)
        if per_layer is None or not all(per_layer):
            return None
        return [sum(counts) / len(counts) for counts in per_layer]


def experts_hit_per_layer(
    core: Any,
    moe: MoEStepBytes,
    batch: int,
    decode: Callable[[], object],
    cache: dict[int, tuple[list[float], str]],
) -> tuple[list[float], str]:
    """Per MoE layer, the distinct experts a decode step of batch requests hits, and whence:
    'routing', counted while decode() runs batch requests through the engine core (untimed;
    the runner's decode graphs set aside meanwhile so that every step runs the hooked eager
    forward), or 'uniform' (the estimate: the engine's model is in another process, or no
    step of exactly batch tokens ran). Kept in cache by batch."""
    if batch in cache:
        return cache[batch]
    model = engine_model(core)
    hit = None
    if model is not None:
        runner = core.executor.worker.runner
        graphs, runner.graphs = runner.graphs, None
        try:
            with ExpertCounter(model).counting() as counter:
                decode()
        finally:
            runner.graphs = graphs
        hit = counter.mean_hit(batch)
    cache[batch] = (hit, "routing") if hit is not None else (moe.expected_hit(batch), "uniform")
    return cache[batch]
