"""The fused MoE kernels (kernels/fused_moe.py): the Triton path (CUDA, or the interpreter here),
the C kernel (fp32 on the CPU, over block_experts_cpu's layout) and the batched torch path
against a per-token reference written here, one token and one of its experts at a time in fp32;
moe_align's layout on its own; the layer's CPU layout giving the stacked layout's output.

Grids stay tiny (the interpreter costs about a millisecond per program): hidden 64, intermediate
32, 8 experts, so one program covers a block's whole output width.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_binding import available
from kernels.fused_moe import (
    block_experts_cpu,
    fused_experts,
    fused_experts_cpu,
    fused_experts_torch,
)
from kernels.triton.fused_moe import fused_experts_triton, moe_align, padded_capacity
from tests.kernels.paged_inputs import TOLERANCE, cuda_only

HIDDEN, INTER, EXPERTS = 64, 32, 8


def reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), token by token, in fp32."""
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    inter = w2.shape[2]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            gate = w13[e, :inter] @ x[t]
            up = w13[e, inter:] @ x[t]
            if b13 is not None:
                gate = gate + b13[e, :inter].float().cpu()
                up = up + b13[e, inter:].float().cpu()
            if activation == "silu":
                h = F.silu(gate) * up
            else:
                if limit is not None:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = w2[e] @ h
            if b2 is not None:
                y = y + b2[e].float().cpu()
            out[t] += float(weights[t, j]) * y
    return out


def _inputs(
    tokens: int,
    top_k: int,
    device: torch.device,
    dtype: torch.dtype,
    experts: int = EXPERTS,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return (
        x.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        weights.to(device),
        ids.to(device),
    )


def _check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected, rtol=tol, atol=tol)


def _cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The C kernel on the stacked experts re-laid as it reads them."""
    if x.device.type != "cpu" or not available():
        pytest.skip("the C kernels run on a CPU where they are built")
    return fused_experts_cpu(x, *block_experts_cpu(w13, w2), *args, **kwargs)


IMPLS = {"triton": fused_experts_triton, "torch": fused_experts_torch, "cpu": _cpu}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 7])
def test_matches_per_token_reference(
    impl: str, top_k: int, tokens: int, device: torch.device
) -> None:
    x, w13, w2, weights, ids = _inputs(tokens, top_k, device, torch.float32)
    out = IMPLS[impl](x, w13, w2, weights, ids)
    _check(out, reference(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_token_on_one_expert_over_several_blocks(impl: str, device: torch.device) -> None:
    """20 tokens all send their first choice to expert 3: 20 rows of one expert fill two blocks
    of 16, the second part padding; the other experts are empty or nearly."""
    x, w13, w2, weights, ids = _inputs(20, 2, device, torch.float32)
    ids[:, 0] = 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, 5, ids[:, 1])
    kwargs = {"block_m": 16} if impl == "triton" else {}
    out = IMPLS[impl](x, w13, w2, weights, ids, **kwargs)
    _check(out, reference(x, w13, w2, weights, ids), torch.float32)


def test_larger_blocks(device: torch.device) -> None:
    """Blocks of 32 rows with several experts each spanning one partly filled block."""
    x, w13, w2, weights, ids = _inputs(24, 2, device, torch.float32, seed=3)
    out = fused_experts_triton(x, w13, w2, weights, ids, block_m=32)
    _check(out, reference(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_biases_and_clamped_swiglu(impl: str, device: torch.device) -> None:
    """gpt-oss's experts: biases on both projections, (up + 1) * gate * sigmoid(1.702 gate) with
    gate and up clamped; the limit is small enough that the clamps bite."""
    x, w13, w2, weights, ids = _inputs(6, 2, device, torch.float32, seed=1)
    x = x * 4
    gen = torch.Generator().manual_seed(2)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=gen).to(device)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen).to(device)
    limit = 1.5
    kwargs = {"activation": "swigluoai", "b13": b13, "b2": b2, "swiglu_limit": limit}
    out = IMPLS[impl](x, w13, w2, weights, ids, **kwargs)
    expected = reference(x, w13, w2, weights, ids, "swigluoai", b13, b2, None, limit)
    _check(out, expected, torch.float32)
    unclamped = reference(x, w13, w2, weights, ids, "swigluoai", b13, b2, None, None)
    assert not torch.allclose(expected, unclamped, atol=1e-3), "the clamp must matter here"


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_map_leaves_other_ranks_experts_out(impl: str, device: torch.device) -> None:
    """Expert parallelism: this rank holds global experts 4..7 as local 0..3; pairs routed to
    0..3 contribute nothing here, and a token whose experts all live elsewhere gets zeros."""
    x, w13, w2, weights, ids = _inputs(9, 2, device, torch.float32, seed=4)
    ids[0] = torch.tensor([0, 2])  # both on another rank
    local_w13, local_w2 = w13[4:].contiguous(), w2[4:].contiguous()
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], device=device)
    out = IMPLS[impl](x, local_w13, local_w2, weights, ids, expert_map=expert_map)
    expected = reference(x, w13, w2, weights, ids, expert_map=torch.tensor([-1] * 4 + [4, 5, 6, 7]))
    _check(out, expected, torch.float32)
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit(dtype: torch.dtype, device: torch.device) -> None:
    """16-bit weights and activations (upcast after loading, fp32 accumulators); the reference
    runs in fp32 from the same rounded inputs, and the kernel rounds h to 16 bits between the
    GEMMs, so the tolerance is that of the dtype."""
    x, w13, w2, weights, ids = _inputs(5, 2, device, dtype, seed=5)
    out = fused_experts_triton(x, w13, w2, weights, ids)
    _check(out, reference(x, w13, w2, weights, ids), dtype)


def test_no_tokens(device: torch.device) -> None:
    x, w13, w2, weights, ids = _inputs(0, 2, device, torch.float32)
    assert fused_experts_triton(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_align_layout() -> None:
    """Every local pair once, each block one expert's pairs in their original order, padding
    rows the pair count, unused blocks -1, and the row count the shapes-only bound."""
    gen = torch.Generator().manual_seed(6)
    tokens, top_k, block_m = 13, 3, 16
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    expert_map = torch.tensor([0, 1, -1, 2, 3, -1, 4, 5])
    sorted_pairs, block_experts = moe_align(ids, 6, block_m, expert_map)
    assert sorted_pairs.numel() == padded_capacity(tokens * top_k, 6, block_m)
    assert block_experts.numel() * block_m == sorted_pairs.numel()
    local = expert_map[ids.reshape(-1)]
    seen: list[int] = []
    for b, expert in enumerate(block_experts.tolist()):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m].tolist()
        pairs = [p for p in rows if p < tokens * top_k]
        if expert < 0:
            assert not pairs
            continue
        assert pairs, "a block is only laid out for an expert with pairs"
        assert all(int(local[p]) == expert for p in pairs)
        assert pairs == sorted(pairs)
        assert rows[: len(pairs)] == pairs, "padding only after an expert's pairs"
        seen += pairs
    assert sorted(seen) == [p for p in range(tokens * top_k) if local[p] >= 0]


def test_dispatcher_on_this_device(device: torch.device) -> None:
    x, w13, w2, weights, ids = _inputs(3, 2, device, torch.float32, seed=7)
    _check(fused_experts(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids), x.dtype)


def test_cpu_kernel_refuses_what_it_would_misread() -> None:
    if not available():
        pytest.skip("the C kernels are not built here")
    x, w13, w2, weights, ids = _inputs(3, 2, torch.device("cpu"), torch.float32)
    b13, b2 = block_experts_cpu(w13, w2)
    with pytest.raises(ValueError, match="blocked experts"):
        fused_experts_cpu(x, w13, w2, weights, ids)  # the stacked layout
    ids[1, 0] = EXPERTS
    with pytest.raises(ValueError, match="out of range"):
        fused_experts_cpu(x, b13, b2, weights, ids)
    with pytest.raises(ValueError, match="multiples of 32"):
        block_experts_cpu(w13[:, :48], w2[:, :, :24])


def test_layer_cpu_layout_gives_the_stacked_layouts_output() -> None:
    """FusedMoE.use_cpu_layout (the loader's CPU pass) switches the layer to the C kernel with
    the same result; with 48-wide experts (not a multiple of 32) it keeps the stacked layout."""
    from config.moe_arch import MoERouting
    from gpu_worker.layers.fused_moe import FusedMoE

    if not available():
        pytest.skip("the C kernels are not built here")
    gen = torch.Generator().manual_seed(8)
    for inter, relaid in ((INTER, True), (48, False)):
        layer = FusedMoE(EXPERTS, HIDDEN, inter, MoERouting(top_k=2), bias=True)
        for e in range(EXPERTS):
            for name, shape in (
                ("gate", (inter, HIDDEN)),
                ("up", (inter, HIDDEN)),
                ("down", (HIDDEN, inter)),
                ("gate_bias", (inter,)),
                ("up_bias", (inter,)),
                ("down_bias", (HIDDEN,)),
            ):
                layer.load_expert(name, e, torch.randn(shape, generator=gen) * 0.2)
        x, logits = torch.randn(6, HIDDEN, generator=gen), torch.randn(6, EXPERTS, generator=gen)
        stacked = layer(x, logits)
        w13, w2 = (t.clone() for t in layer.stacked_experts())
        layer.use_cpu_layout()
        assert layer.cpu_layout == relaid
        assert all(map(torch.equal, layer.stacked_experts(), (w13, w2)))
        torch.testing.assert_close(layer(x, logits), stacked, rtol=1e-5, atol=1e-5)


class _DeviceOnly(torch.Tensor):
    """A tensor the host may not read (as a GPU tensor inside a captured graph)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}:
            raise AssertionError(f"host read in moe_align: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_align_reads_nothing_on_the_host() -> None:
    """moe_align's sizes come from shapes alone, so CUDA graphs can capture it."""
    gen = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(5)])
    expert_map = torch.tensor([0, 1, -1, 2, 3, -1, 4, 5])
    guarded = moe_align(ids.as_subclass(_DeviceOnly), 6, 16, expert_map.as_subclass(_DeviceOnly))
    plain = moe_align(ids, 6, 16, expert_map)
    assert all(torch.equal(a.as_subclass(torch.Tensor), b) for a, b in zip(guarded, plain))


@cuda_only("CUDA graphs and the device's tile sizes")
def test_captured_in_a_cuda_graph_and_replayed_with_new_routing() -> None:
    """The whole path (moe_align and both kernels) captured once, then replayed with other
    tokens and other experts: the graph's result equals an eager call's."""
    device = torch.device("cuda")
    x, w13, w2, weights, ids = _inputs(24, 4, device, torch.bfloat16, seed=10)
    fused_experts_triton(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = _inputs(24, 4, device, torch.bfloat16, seed=11)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, fused_experts_triton(x2, w13, w2, weights2, ids2))


@cuda_only("the device's tile sizes at a larger shape")
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_device_tiles_at_a_larger_shape(tokens: int) -> None:
    """bf16 at 512 hidden, 384 intermediate, 32 experts, top-8 (1, 64 and 300 tokens: BLOCK_M
    16, 32 and 64), against the torch path in fp32."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 512, 384, 32, 8
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    cuda = [t.cuda() for t in (x, w13, w2)]
    out = fused_experts_triton(*(t.bfloat16() for t in cuda), weights.cuda(), ids.cuda())
    torch.testing.assert_close(out.float().cpu(), expected, rtol=3e-2, atol=3e-2)


def test_loader_gives_a_models_moe_layers_the_cpu_layout(tmp_path) -> None:
    """Loading a model on the CPU re-lays every FusedMoE for the C kernel where it runs
    (gpu_worker/loader/cpu_layout.py), and the re-laid experts are the checkpoint's."""
    from safetensors.torch import load_file

    from gpu_worker.layers.fused_moe import FusedMoE
    from tests.tiny_models import make_tiny_model
    from tests.worker.runner_utils import make_runner

    if not available():
        pytest.skip("the C kernels are not built here")
    model_dir = make_tiny_model(
        tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    runner, _ = make_runner(model_dir, kv_cache_memory="4MiB")
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.cpu_layout for m in layers)
    checkpoint = load_file(model_dir / "model.safetensors")
    w13, w2 = layers[0].stacked_experts()
    prefix = "model.layers.0.mlp.experts.3"
    torch.testing.assert_close(w13[3, :32], checkpoint[f"{prefix}.gate_proj.weight"])
    torch.testing.assert_close(w13[3, 32:], checkpoint[f"{prefix}.up_proj.weight"])
    torch.testing.assert_close(w2[3], checkpoint[f"{prefix}.down_proj.weight"])
