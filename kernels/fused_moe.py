"""A mixture of experts' gated MLPs for all tokens of a step: each token's top_k experts, their
outputs weighted by the router and summed.

Weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I], optional
biases b13 [E, 2I] and b2 [E, H]. Activations: "silu" (SwiGLU, silu(gate) * up) and
"swigluoai" (gpt-oss: gate and up clamped to swiglu_limit, (up + 1) * gate * sigmoid(1.702 *
gate)). expert_map [E_global] maps a global expert id to this rank's local one, -1 where the
expert lives on another rank (expert parallelism); those tokens' contributions come from the
rank that holds it.

fused_experts_torch: batched torch ops over tokens sorted by expert, each active expert's
weights read once per step (any device; it reads the per-expert token counts on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swigluoai")
_OAI_ALPHA = 1.702


def moe_activation_torch(
    h: torch.Tensor, activation: str, swiglu_limit: float | None
) -> torch.Tensor:
    """h [N, 2I] = [gate | up] -> [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        if swiglu_limit is not None:
            gate = gate.clamp(max=swiglu_limit)
            up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * _OAI_ALPHA))
    raise ValueError(f"MoE activation {activation!r} is not supported: {', '.join(ACTIVATIONS)}")


def fused_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H]: [T, H] in
    x's dtype."""
    tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    ids = topk_ids.reshape(-1)
    if expert_map is not None:
        ids = expert_map[ids]
    num_local = w13.shape[0]
    # Every (token, k) pair sorted by its local expert; pairs for other ranks' experts (-1) last.
    order = torch.where(ids < 0, num_local, ids).argsort(stable=True)
    counts = torch.bincount(ids[ids >= 0], minlength=num_local).tolist()
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        rows = pairs // top_k
        h = F.linear(x.index_select(0, rows), w13[expert], None if b13 is None else b13[expert])
        y = F.linear(
            moe_activation_torch(h, activation, swiglu_limit),
            w2[expert],
            None if b2 is None else b2[expert],
        )
        scale = flat_weights.index_select(0, pairs).to(y.dtype).unsqueeze(-1)
        out.index_add_(0, rows, y * scale)
    return out
