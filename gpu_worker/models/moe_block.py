"""The sparse feed-forward block Qwen3-MoE and Mixtral share: a router (`gate`, a linear map
hidden -> one logit per expert, no bias; gpt-oss's has a bias) and the experts (FusedMoE at
`experts`), plus the reader of transformers 5's stacked expert tensors. The config.json fields
are parsed in config/moe_arch.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from config.moe_arch import MoERouting
from gpu_worker.layers.fused_moe import FusedMoE


class Router(nn.Module):
    """x [T, H] -> router logits [T, E] = x @ weight^T (+ bias [E] when bias), weight [E, H],
    replicated on every rank (each computes every token's choice).

    Not the engine's Linear: its CPU layouts are for wide projections; on a router's few dozen
    output columns the split layout it gets is 2-3x slower than torch's matmul (H 512, E 16,
    2 threads, medians of 7 alternating rounds: 16 vs 5 us at 1 token, 30 vs 14 at 64, 1435
    vs 612 at 2048)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SparseMoeBlock(nn.Module):
    """x [T, H] -> the weighted sum of each token's top-k experts' gated MLPs [T, H]: the router
    (`gate`) then the experts (`experts`), split as FusedMoE says (the intermediate dimension,
    or whole experts per rank)."""

    def __init__(
        self, hidden_size: int, num_experts: int, intermediate_size: int, routing: MoERouting
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def unstack_experts(
    weights: Iterable[tuple[str, str, torch.Tensor]], gate: str, up: str, down: str
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Checkpoint tensors with transformers 5's stacked expert layout
    (`<moe>.experts.gate_up_proj` [E, 2I, H], `<moe>.experts.down_proj` [E, H, I], as
    save_pretrained(save_original_format=False) writes them) split into the per-expert tensors
    `<moe>.experts.<e>.<gate|up|down>.weight` the original checkpoints have; every other
    tensor passes through unchanged."""
    for source, name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj" and tensor.dim() == 3:
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield source, f"{prefix}.experts.{e}.{gate}.weight", tensor[e, :inter]
                yield source, f"{prefix}.experts.{e}.{up}.weight", tensor[e, inter:]
        elif leaf == "down_proj" and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                yield source, f"{prefix}.experts.{e}.{down}.weight", tensor[e]
        else:
            yield source, name, tensor
