"""A mixture of experts' gated MLPs for all tokens of a step: each token's top_k experts, their
outputs weighted by the router and summed.

Weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I], optional
biases b13 [E, 2I] and b2 [E, H]. Activations: "silu" (SwiGLU, silu(gate) * up) and
"swigluoai" (gpt-oss: gate and up clamped to swiglu_limit, (up + 1) * gate * sigmoid(1.702 *
gate)). expert_map [E_global] maps a global expert id to this rank's local one, -1 where the
expert lives on another rank (expert parallelism); those tokens' contributions come from the
rank that holds it.

fused_experts_triton (CUDA; kernels/triton/fused_moe.py): the (token, k) pairs sorted by expert on
the device into blocks of BLOCK_M rows of one expert each (moe_align), then two grouped GEMMs over
those blocks, vLLM's fused_moe shape: kernel 1 x @ w13[e]^T (+ b13) with the activation applied in
registers (each program holds the gate and up columns of the same outputs), kernel 2 h @ w2[e]^T (+
b2) times the router weight into a [T, k, H] fp32 buffer, summed over k. No host syncs and no
data-dependent shapes (the padded row count has a fixed bound), so it can be captured in CUDA
graphs.
fused_experts_torch: batched torch ops over tokens sorted by expert, each active expert's
weights read once per step (any device; it reads the per-expert token counts on the host).
fused_experts_cpu: the C kernel (kernels/cpu/fused_moe.c) for fp32 CPU tensors, over weights
re-laid once by block_experts_cpu: one call a step, each active expert's weights read once, the
threads splitting every expert's columns (so a decode step's few experts keep all cores busy).
fused_experts: the dispatcher for weights in the stacked layout, Triton on CUDA, the torch path
elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_binding import available, check_cpu, library
from kernels.moe_activation import ACTIVATION_CODES, ACTIVATIONS

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


# -- the CPU path: one C call over blocked weights ----------------------------------------------

# Columns per weight block of the C kernel (linear.c's GEMM tiles).
CPU_BLOCK = 32


def cpu_fits(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether fused_experts_cpu can run these stacked experts: fp32 on the CPU with the C
    kernels built, hidden and intermediate sizes multiples of CPU_BLOCK."""
    inter, hidden = w2.shape[2], w2.shape[1]
    return (
        w13.dtype == torch.float32
        and w13.device.type == "cpu"
        and not inter % CPU_BLOCK
        and not hidden % CPU_BLOCK
        and available()
    )


def block_experts_cpu(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] as fused_experts_cpu reads them: [E, I/32, 2, H, 32]
    (each expert's gate block j then its up block j, 32 columns wide, k-major) and
    [E, H/32, I, 32]."""
    experts, hidden, inter = w2.shape
    if not cpu_fits(w13, w2):
        raise ValueError(
            f"experts of hidden size {hidden} and intermediate size {inter} ({w13.dtype} on "
            f"{w13.device}) do not fit the CPU kernel: fp32, multiples of {CPU_BLOCK}"
        )
    blocks = inter // CPU_BLOCK
    w13_blocked = w13.view(experts, 2, blocks, CPU_BLOCK, hidden).permute(0, 2, 1, 4, 3)
    w2_blocked = w2.view(experts, hidden // CPU_BLOCK, CPU_BLOCK, inter).permute(0, 1, 3, 2)
    return w13_blocked.contiguous(), w2_blocked.contiguous()


def fused_experts_cpu(
    x: torch.Tensor,
    w13_blocked: torch.Tensor,
    w2_blocked: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """fused_experts_torch's result by the C kernel, for fp32 CPU tensors and weights laid out
    by block_experts_cpu; ValueError for a layout it would misread or an expert id out of
    range."""
    if activation not in ACTIVATION_CODES:
        raise ValueError(
            f"MoE activation {activation!r} is not supported: {', '.join(ACTIVATIONS)}"
        )
    for name, t in (("x", x), ("w13", w13_blocked), ("w2", w2_blocked), ("weights", topk_weights)):
        check_cpu(t, name)
    check_cpu(topk_ids, "topk_ids", torch.int64)
    if w13_blocked.dim() != 5 or w2_blocked.dim() != 4:
        raise ValueError(
            f"w13 {tuple(w13_blocked.shape)} and w2 {tuple(w2_blocked.shape)} are not the "
            "blocked experts of block_experts_cpu"
        )
    experts, blocks, two, hidden, width = w13_blocked.shape
    inter = blocks * CPU_BLOCK
    if (
        (two, width) != (2, CPU_BLOCK)
        or w2_blocked.shape != (experts, hidden // CPU_BLOCK, inter, CPU_BLOCK)
        or not (w13_blocked.is_contiguous() and w2_blocked.is_contiguous())
        or x.dim() != 2
        or x.shape[1] != hidden
        or x.stride(1) != 1
    ):
        raise ValueError(
            f"x {tuple(x.shape)}, w13 {tuple(w13_blocked.shape)} and w2 "
            f"{tuple(w2_blocked.shape)} are not the blocked experts of block_experts_cpu"
        )
    tokens, top_k = topk_ids.shape
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    if weights.shape != ids.shape:
        raise ValueError(f"topk_weights {tuple(weights.shape)} != topk_ids {tuple(ids.shape)}")
    for name, bias, shape in (("b13", b13, (experts, 2 * inter)), ("b2", b2, (experts, hidden))):
        if bias is not None:
            check_cpu(bias, name)
            if bias.shape != shape or not bias.is_contiguous():
                raise ValueError(f"{name} {tuple(bias.shape)} is not a contiguous {shape}")
    num_global = experts
    if expert_map is not None:
        check_cpu(expert_map, "expert_map", torch.int64)
        expert_map = expert_map.contiguous()
        num_global = expert_map.numel()
    out = torch.empty(tokens, hidden)
    status = library().fused_moe_f32(
        x.data_ptr(),
        x.stride(0),
        tokens,
        hidden,
        ids.data_ptr(),
        weights.data_ptr(),
        top_k,
        None if expert_map is None else expert_map.data_ptr(),
        num_global,
        w13_blocked.data_ptr(),
        None if b13 is None else b13.data_ptr(),
        w2_blocked.data_ptr(),
        None if b2 is None else b2.data_ptr(),
        experts,
        inter,
        ACTIVATION_CODES[activation],
        swiglu_limit is not None,
        0.0 if swiglu_limit is None else swiglu_limit,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == 1:
        raise ValueError(f"an expert id is out of range (the map has {num_global} experts)")
    if status:
        raise MemoryError("the MoE kernel could not allocate its scratch")
    return out


# -- the device path: kernels/triton/fused_moe.py ----------------------------------------------


def fused_experts(
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
    """The experts' weighted sum by whichever path runs on x's device: the Triton kernels on
    CUDA, the batched torch path elsewhere."""
    impl = fused_experts_torch
    if x.device.type == "cuda":
        from kernels.triton.fused_moe import fused_experts_triton  # Triton only where it runs

        impl = fused_experts_triton
    return impl(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        b13=b13,
        b2=b2,
        expert_map=expert_map,
        swiglu_limit=swiglu_limit,
    )
