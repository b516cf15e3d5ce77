"""A mixture of experts as one layer: the router's choice (moe_routing.py) and every expert's
gated MLP for all tokens of a step (kernels/fused_moe.py).

The experts' weights are stacked: w13_weight [E_local, 2 * I_local, H] (each expert's gate rows,
then its up rows) and w2_weight [E_local, H, I_local], with biases where the family has them.
Under tensor parallelism each rank holds every expert's I / TP slice of the intermediate
dimension and the ranks' partial outputs are summed; with expert parallelism each rank holds
E / TP whole experts and the sum collects each token's experts from the ranks that hold them.
The loader hands in checkpoint tensors one expert at a time (load_expert), by global expert id.
"""

from __future__ import annotations

import torch
from torch import nn

from config.moe_arch import MoERouting
from gpu_worker.layers.moe_routing import select_experts
from gpu_worker.parallel.group import expert_parallel, tp_all_reduce, tp_rank, tp_world_size
from kernels.fused_moe import (
    ACTIVATIONS,
    block_experts_cpu,
    cpu_fits,
    fused_experts,
    fused_experts_cpu,
)

# The checkpoint tensors of one expert, as load_expert names them.
EXPERT_TENSORS = ("gate", "up", "down")
EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")


class FusedMoE(nn.Module):
    """forward(x [T, H], router_logits [T, E]) -> [T, H], summed over the ranks."""

    # Global expert id -> this rank's local one, -1 for other ranks' (expert parallelism only).
    expert_map: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: MoERouting,
        *,
        activation: str = "silu",
        bias: bool = False,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"MoE activation {activation!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        if routing.top_k > num_experts:
            raise ValueError(
                f"num_experts_per_tok ({routing.top_k}) exceeds the number of experts "
                f"({num_experts})"
            )
        world, rank = tp_world_size(), tp_rank()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.routing, self.activation, self.swiglu_limit = routing, activation, swiglu_limit
        self.expert_parallel = expert_parallel() and world > 1
        if self.expert_parallel:
            if num_experts % world:
                raise ValueError(
                    f"expert parallelism: the {num_experts} experts do not divide evenly over "
                    f"{world} ranks"
                )
            self.num_local_experts = num_experts // world
            self.first_expert = rank * self.num_local_experts
            self.intermediate = intermediate_size
            self.tp_split = 1
        else:
            if intermediate_size % world:
                raise ValueError(
                    f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                    f"tensor_parallel_size {world}"
                )
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate = intermediate_size // world
            self.tp_split = world
        local, inter = self.num_local_experts, self.intermediate
        self.w13_weight = nn.Parameter(
            torch.empty(local, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
        self.w13_bias = (
            nn.Parameter(torch.empty(local, 2 * inter), requires_grad=False) if bias else None
        )
        self.w2_bias = (
            nn.Parameter(torch.empty(local, hidden_size), requires_grad=False) if bias else None
        )
        expert_map = None
        if self.expert_parallel:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
            expert_map[self.first_expert : self.first_expert + local] = torch.arange(local)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self._loaded: set[tuple[str, int]] = set()
        # Whether w13/w2 hold kernels.fused_moe.block_experts_cpu's layout (use_cpu_layout).
        self.cpu_layout = False

    # -- loading ------------------------------------------------------------------------------

    def load_expert(self, name: str, expert: int, tensor: torch.Tensor) -> None:
        """Copy one expert's checkpoint tensor: name is gate, up, down ([I, H], [I, H], [H, I])
        or their biases gate_bias, up_bias ([I]), down_bias ([H]); expert the global id. A
        tensor of an expert another rank holds is skipped. Raises ValueError on a wrong shape
        or name."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the model has {self.num_experts})")
        full_inter = self.intermediate * self.tp_split
        expected = {
            "gate": (full_inter, self.hidden_size),
            "up": (full_inter, self.hidden_size),
            "down": (self.hidden_size, full_inter),
            "gate_bias": (full_inter,),
            "up_bias": (full_inter,),
            "down_bias": (self.hidden_size,),
        }.get(name)
        if expected is None or (name in EXPERT_BIASES and self.w13_bias is None):
            raise ValueError(f"expert tensor {name!r} does not belong to this layer")
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"expert {expert} {name} has shape {tuple(tensor.shape)}, "
                f"the model expects {expected}"
            )
        self._loaded.add((name, expert))
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        inter = self.intermediate
        part = (tp_rank() if self.tp_split > 1 else 0) * inter
        if name in ("gate", "up"):
            row = 0 if name == "gate" else inter
            self.w13_weight.data[local, row : row + inter].copy_(tensor[part : part + inter])
        elif name == "down":
            self.w2_weight.data[local].copy_(tensor[:, part : part + inter])
        elif name in ("gate_bias", "up_bias"):
            assert self.w13_bias is not None
            row = 0 if name == "gate_bias" else inter
            self.w13_bias.data[local, row : row + inter].copy_(tensor[part : part + inter])
        else:
            assert self.w2_bias is not None
            self.w2_bias.data[local].copy_(tensor)

    def missing(self) -> list[str]:
        """The expert tensors no checkpoint tensor has filled, as 'experts.<e>.<name>'."""
        names = EXPERT_TENSORS + (EXPERT_BIASES if self.w13_bias is not None else ())
        return [
            f"{e}.{name}"
            for e in range(self.num_experts)
            for name in names
            if (name, e) not in self._loaded
        ]

    def use_cpu_layout(self) -> None:
        """After loading, on the CPU: re-lay the experts' weights for the C kernel where it runs
        them (fp32, sizes multiples of 32, library built); forward then calls it. Otherwise the
        stacked layout stays."""
        if self.cpu_layout or not cpu_fits(self.w13_weight, self.w2_weight):
            return
        w13, w2 = block_experts_cpu(self.w13_weight.data, self.w2_weight.data)
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.cpu_layout = True

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E_local, 2 * I_local, H], w2 [E_local, H, I_local]) in the stacked layout,
        whichever layout the layer runs (a copy after use_cpu_layout)."""
        if not self.cpu_layout:
            return self.w13_weight.data, self.w2_weight.data
        experts, blocks, _, hidden, width = self.w13_weight.shape
        w13 = self.w13_weight.data.permute(0, 2, 1, 4, 3).reshape(
            experts, 2 * blocks * width, hidden
        )
        w2 = self.w2_weight.data.permute(0, 1, 3, 2).reshape(experts, hidden, -1)
        return w13, w2

    # -- compute ------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """correction_bias: DeepSeek-V3's e_score_correction_bias, a parameter of the family's
        router (gate), steering the choice of experts only."""
        weights, ids = select_experts(router_logits, self.routing, correction_bias)
        b2 = self.w2_bias
        if b2 is not None and self.tp_split > 1 and tp_rank() != 0:
            b2 = None  # each expert's output bias once over the ranks' sum
        # The C kernel on re-laid fp32 weights (use_cpu_layout), else Triton or torch.
        impl = fused_experts_cpu if self.cpu_layout else fused_experts
        out = impl(
            x,
            self.w13_weight,
            self.w2_weight,
            weights,
            ids,
            activation=self.activation,
            b13=self.w13_bias,
            b2=b2,
            expert_map=self.expert_map,
            swiglu_limit=self.swiglu_limit,
        )
        return tp_all_reduce(out)
