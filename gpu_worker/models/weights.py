"""Copying checkpoint tensors into a model whose projections are fused and may be split by rank."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.parallel.group import tp_rank, tp_world_size


class StackedShard(NamedTuple):
    """Checkpoint tensor `original` is a slice of fused parameter `fused`, named by shard_id."""

    fused: str
    original: str
    shard_id: str | int


class ExpertShard(NamedTuple):
    """Checkpoint tensor `<moe>.experts.<e>.<original>.weight` (and .bias) is expert e's
    `tensor` (gate, up or down: FusedMoE.load_expert) of the FusedMoE module at <moe>.experts."""

    original: str
    tensor: str


# The per-expert projections as Qwen-MoE, DeepSeek and most checkpoints name them.
GATED_EXPERTS = (
    ExpertShard("gate_proj", "gate"),
    ExpertShard("up_proj", "up"),
    ExpertShard("down_proj", "down"),
)

_EXPERT_NAME = re.compile(
    r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<kind>weight|bias)$"
)


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model; the message names the file and the tensor."""


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, str, torch.Tensor]],
    stacked: Iterable[StackedShard],
    skip: tuple[str, ...] = (),
    experts: Iterable[ExpertShard] = (),
) -> None:
    """Copy every (file, name, tensor) into model; refuse unknown, misshapen or missing tensors.

    A parameter split across tensor-parallel ranks (tp_dim set) receives this rank's slice; an
    expert's tensor (experts: how the checkpoint names them) goes to its FusedMoE module.
    """
    params = dict(model.named_parameters())
    stacked = tuple(stacked)
    expert_tensors = {e.original: e.tensor for e in experts}
    moe_modules = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
    pending = {
        name: _expected_shards(name, stacked)
        for name in params
        if name.rsplit(".", 1)[0] not in moe_modules
    }
    sources: dict[str, None] = {}
    for source, name, tensor in weights:
        sources.setdefault(source)
        if name.endswith(skip):
            continue
        if (match := _EXPERT_NAME.match(name)) and match["proj"] in expert_tensors:
            moe = moe_modules.get(match["moe"])
            if moe is None:
                raise WeightLoadError(
                    f"{source}: tensor {name!r} does not belong to this model "
                    f"({type(model).__name__})"
                )
            suffix = "_bias" if match["kind"] == "bias" else ""
            try:
                moe.load_expert(
                    expert_tensors[match["proj"]] + suffix, int(match["expert"]), tensor
                )
            except ValueError as e:
                raise WeightLoadError(f"{source}: tensor {name!r}: {e}") from None
            continue
        shard = next((s for s in stacked if f".{s.original}." in name), None)
        target = name.replace(f".{shard.original}.", f".{shard.fused}.") if shard else name
        param = params.get(target)
        if param is None:
            raise WeightLoadError(
                f"{source}: tensor {name!r} does not belong to this model ({type(model).__name__})"
            )
        dest = param.data
        if shard is not None:
            owner = model.get_submodule(target.rsplit(".", 2)[0])
            start, size = owner.shard_slice(shard.shard_id)
            dest = dest.narrow(0, start, size)
        expected = _checkpoint_shape(param, dest)
        if tuple(tensor.shape) != expected:
            raise WeightLoadError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {expected}"
            )
        tensor, dest = _rank_slice(param, tensor, dest)
        dest.copy_(tensor)
        pending[target].discard(shard.shard_id if shard else None)
    # Name what is missing as the checkpoint would (k_proj, not the fused qkv_proj).
    missing = sorted(
        _checkpoint_name(n, shard_id, stacked) for n, left in pending.items() for shard_id in left
    ) + [
        _expert_checkpoint_name(n, left, expert_tensors)
        for n, moe in moe_modules.items()
        for left in moe.missing()
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        where = ", ".join(sources) or "checkpoint"
        raise WeightLoadError(f"{where}: checkpoint is missing tensors: {shown}")


def _checkpoint_shape(param: torch.Tensor, dest: torch.Tensor) -> tuple[int, ...]:
    """The shape of dest's checkpoint tensor: this rank's slice scaled back to all ranks."""
    shape = list(dest.shape)
    dim = getattr(param, "tp_dim", None)
    if dim is not None:
        shape[dim] = getattr(param, "tp_full_size", shape[dim] * tp_world_size())
    return tuple(shape)


def _rank_slice(
    param: torch.Tensor, tensor: torch.Tensor, dest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a checkpoint tensor and the part of dest it fills.

    Ranks hold equal slices; where the size does not divide (the vocabulary), the last rank's
    slice runs past the tensor's end; its padding rows are never used (ids and logits past
    the vocabulary are cut off).
    """
    dim = getattr(param, "tp_dim", None)
    if dim is None or tp_world_size() == 1:
        return tensor, dest
    per_rank = dest.shape[dim]
    start = tp_rank() * per_rank
    size = max(0, min(per_rank, tensor.shape[dim] - start))
    return tensor.narrow(dim, start, size), dest.narrow(dim, 0, size)


def _expert_checkpoint_name(moe: str, missing: str, expert_tensors: dict[str, str]) -> str:
    """FusedMoE.missing()'s '<e>.<tensor>' as the checkpoint names it
    ('<moe>.<e>.<original>.weight' or .bias)."""
    expert, tensor = missing.split(".", 1)
    kind = "bias" if tensor.endswith("_bias") else "weight"
    originals = {t: o for o, t in expert_tensors.items()}
    original = originals.get(tensor.removesuffix("_bias"), tensor)
    return f"{moe}.{expert}.{original}.{kind}"


def _expected_shards(param_name: str, stacked: tuple[StackedShard, ...]) -> set[str | int | None]:
    ids = {s.shard_id for s in stacked if f".{s.fused}." in param_name}
    return ids or {None}


def _checkpoint_name(
    param_name: str, shard_id: str | int | None, stacked: tuple[StackedShard, ...]
) -> str:
    if shard_id is None:
        return param_name
    shard = next(s for s in stacked if s.shard_id == shard_id and f".{s.fused}." in param_name)
    return param_name.replace(f".{shard.fused}.", f".{shard.original}.")
