"""The tensor-parallel process group of this process, and the collectives the model uses.

One group per process (one worker process per rank), kept in module state so that layers read
their rank and world size while the model is being built. Without init_tensor_parallel() the
process is rank 0 of 1 and every collective is the identity.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1
# --enable-expert-parallel: mixture-of-experts layers place whole experts on the ranks of this
# group instead of splitting every expert's intermediate dimension.
_expert_parallel = False


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float = 600.0
) -> None:
    """Join the group of world_size ranks: gloo on CPU, NCCL on CUDA."""
    global _rank, _world_size
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    _rank, _world_size = rank, world_size


def destroy_tensor_parallel() -> None:
    """Leave the group."""
    global _rank, _world_size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def set_expert_parallel(enabled: bool) -> None:
    """Whether the MoE layers built from now on place whole experts on the ranks."""
    global _expert_parallel
    _expert_parallel = enabled


def expert_parallel() -> bool:
    """Whether MoE layers place whole experts on the ranks (set_expert_parallel)."""
    return _expert_parallel


def tp_rank() -> int:
    """This process's rank in the tensor-parallel group."""
    return _rank


def tp_world_size() -> int:
    """The number of ranks the model is split across."""
    return _world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over all ranks (in place)."""
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
