"""Which experts each token goes to, and with what weight: the router of a mixture of experts.

One MoERouting says how a family routes (Mixtral and Qwen3-MoE: softmax, top-k, renormalised;
gpt-oss: top-k of the logits, softmax over them, the same; DeepSeek-V3: sigmoid scores, a
correction bias that only steers the choice, top-k within the best groups, renormalised and
scaled; config/moe_arch.py defines it, where the configuration parses it); select_experts()
applies it to a step's router logits in a few batched ops.
"""

from __future__ import annotations

import torch

from config.moe_arch import MoERouting


def select_experts(
    router_logits: torch.Tensor,
    routing: MoERouting,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k] int64) for router_logits [T, E].

    correction_bias [E] (DeepSeek-V3's e_score_correction_bias) is added to the scores for
    choosing only; the weights are the unbiased scores of the chosen experts.
    """
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        choice = _mask_to_best_groups(choice, routing)
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    # top_k 1 too: Mixtral's (and transformers') renormalised top-1 weight is 1.
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def _mask_to_best_groups(choice: torch.Tensor, routing: MoERouting) -> torch.Tensor:
    """choice with the experts outside each token's topk_groups best groups set to -inf."""
    tokens, experts = choice.shape
    if experts % routing.num_groups:
        raise ValueError(f"n_routed_experts ({experts}) is not divisible by n_group")
    grouped = choice.view(tokens, routing.num_groups, experts // routing.num_groups)
    if routing.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(routing.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
