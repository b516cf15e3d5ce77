"""gpt-oss (20b, 120b): the shared decoder with biases on q, k, v and o, a learned sink logit
per query head, sliding-window layers alternating with full ones (config.json's layer_types),
YaRN rotary embeddings, and in every layer a mixture of experts: router `mlp.router` (a linear
map with bias), the top num_experts_per_tok logits softmaxed over themselves, experts with
biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate and up clamped to
swiglu_limit).

The experts come as whole-layer tensors: unquantized as transformers writes them
(`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved on the last dimension,
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]), or in MXFP4 as
the official checkpoints ship them (`gate_up_proj_blocks`/`_scales`, `down_proj_blocks`/
`_scales`, quantization_config {"quant_method": "mxfp4"}), dequantized at load
(gpu_worker/loader/mxfp4.py: there is no 4-bit kernel here). Both become per-expert tensors for
FusedMoE before load_named_weights sees them (expert_tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from config.attention import SINK_ARCHITECTURES
from config.model_arch import ModelArchConfig
from config.moe_arch import GptOssMoeConfig, MoERouting
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.loader.mxfp4 import dequantize_mxfp4
from gpu_worker.models.blocks import SelfAttention
from gpu_worker.models.decoder import DecoderForCausalLM, Weights
from gpu_worker.models.moe_block import Router
from gpu_worker.models.weights import GATED_EXPERTS, WeightLoadError


class GptOssMoeBlock(nn.Module):
    """x [T, H] -> the router-weighted sum of each token's top-k experts [T, H]; the router is
    replicated on every rank, the experts split as FusedMoE says."""

    def __init__(self, hidden_size: int, moe: GptOssMoeConfig) -> None:
        super().__init__()
        experts = moe.num_local_experts
        self.router = Router(hidden_size, experts, bias=True)
        # Softmax over the top-k logits equals the softmax over all, renormalised over the k.
        routing = MoERouting(top_k=moe.num_experts_per_tok, scoring="softmax", renormalize=True)
        self.experts = FusedMoE(
            experts,
            hidden_size,
            moe.intermediate_size,
            routing,
            activation="swigluoai",
            bias=True,
            swiglu_limit=moe.swiglu_limit,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(DecoderForCausalLM):
    expert_shards = GATED_EXPERTS

    def __init__(self, cfg: ModelArchConfig) -> None:
        self.moe = GptOssMoeConfig.from_hf(cfg.hf_config)
        super().__init__(cfg)

    def attention_block(self, cfg: ModelArchConfig, layer_idx: int) -> SelfAttention:
        return SelfAttention(
            cfg,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            sliding_window=cfg.layer_sliding_window(layer_idx),
            sinks=cfg.architecture in SINK_ARCHITECTURES,
        )

    def mlp_block(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        return GptOssMoeBlock(cfg.hidden_size, self.moe)

    def rewrite_weights(self, weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
        return expert_tensors(_sinks_renamed(weights), next(self.parameters()).device)


def _sinks_renamed(weights: Weights) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The checkpoint's `self_attn.sinks` is the attention layer's parameter (self_attn.attn)."""
    for source, name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            name = name.removesuffix("sinks") + "attn.sinks"
        yield source, name, tensor


_PROJECTIONS = ("gate_up_proj", "down_proj")
_MXFP4_PARTS = ("_blocks", "_scales")


def expert_tensors(
    weights: Weights, device: torch.device | None = None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The stream with gpt-oss's whole-layer expert tensors rewritten as the per-expert
    `<moe>.experts.<e>.<gate_proj|up_proj|down_proj>.<weight|bias>` tensors GATED_EXPERTS maps
    ([I, H], [I, H], [H, I]; [I], [I], [H]): gate and up de-interleaved, the projections
    transposed, MXFP4 blocks and scales dequantized one expert at a time on `device` (the
    model's; default the tensor's) in float32. Every other tensor passes through; raises
    WeightLoadError naming a tensor of the wrong rank or dtype, or MXFP4 blocks without their
    scales (or the reverse)."""
    halves: dict[str, tuple[str, str, torch.Tensor]] = {}  # one MXFP4 part awaiting the other
    for source, name, tensor in weights:
        prefix, sep, leaf = name.rpartition(".experts.")
        if not sep or "." in leaf:
            yield source, name, tensor
            continue
        moe = f"{prefix}.experts"
        if leaf.removesuffix("_bias") in _PROJECTIONS:
            _check_rank(source, name, tensor, 2 if leaf.endswith("_bias") else 3)
            yield from _split_experts(source, moe, leaf, tensor)
            continue
        part = next((p for p in _MXFP4_PARTS if leaf.endswith(p)), "")
        proj = leaf.removesuffix(part)
        if not part or proj not in _PROJECTIONS:
            yield source, name, tensor
            continue
        _check_rank(source, name, tensor, 4 if part == "_blocks" else 3)
        other = halves.pop(f"{moe}.{proj}", None)
        if other is None or other[1] == part:
            halves[f"{moe}.{proj}"] = (source, part, tensor)
            continue
        blocks, scales = (tensor, other[2]) if part == "_blocks" else (other[2], tensor)
        yield from _dequantized_experts(source, f"{moe}.{proj}", blocks, scales, device)
    for key, (source, part, _) in halves.items():
        missing = "_scales" if part == "_blocks" else "_blocks"
        raise WeightLoadError(f"{source}: {key}{part} has no {key}{missing} in the checkpoint")


def _dequantized_experts(
    source: str,
    name: str,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    device: torch.device | None,
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """One MXFP4 whole-layer projection (name: `<moe>.experts.<gate_up_proj|down_proj>`) as
    each expert's float32 tensors, dequantized one expert at a time on device."""
    if blocks.shape[:-1] != scales.shape:
        raise WeightLoadError(
            f"{source}: {name}_blocks {tuple(blocks.shape)} and {name}_scales "
            f"{tuple(scales.shape)} do not pair"
        )
    moe, proj = name.rsplit(".", 1)
    target = device or blocks.device
    for e in range(blocks.shape[0]):
        try:
            dense = dequantize_mxfp4(blocks[e].to(target), scales[e].to(target))
        except ValueError as err:
            raise WeightLoadError(f"{source}: {name}_blocks/_scales: {err}") from None
        # Dequantized rows are the outputs: gate_up [2I, H] interleaved, down [H, I].
        if proj == "gate_up_proj":
            yield source, f"{moe}.{e}.gate_proj.weight", dense[0::2]
            yield source, f"{moe}.{e}.up_proj.weight", dense[1::2]
        else:
            yield source, f"{moe}.{e}.down_proj.weight", dense


def _split_experts(
    source: str, moe: str, leaf: str, tensor: torch.Tensor
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """One unquantized whole-layer tensor as each expert's (transformers' layout: x @ W)."""
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if leaf == "gate_up_proj":  # [H, 2I]
            yield source, f"{moe}.{e}.gate_proj.weight", t[:, 0::2].t()
            yield source, f"{moe}.{e}.up_proj.weight", t[:, 1::2].t()
        elif leaf == "gate_up_proj_bias":  # [2I]
            yield source, f"{moe}.{e}.gate_proj.bias", t[0::2]
            yield source, f"{moe}.{e}.up_proj.bias", t[1::2]
        elif leaf == "down_proj":  # [I, H]
            yield source, f"{moe}.{e}.down_proj.weight", t.t()
        else:  # down_proj_bias [H]
            yield source, f"{moe}.{e}.down_proj.bias", t


def _check_rank(source: str, name: str, tensor: torch.Tensor, rank: int) -> None:
    if tensor.dim() != rank:
        raise WeightLoadError(
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}; gpt-oss's experts "
            f"tensor has {rank} dimensions"
        )
