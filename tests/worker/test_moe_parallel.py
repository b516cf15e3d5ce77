"""A mixture-of-experts layer split over two ranks (gloo, CPU) equals the whole layer on one:
tensor parallelism (every expert's intermediate dimension halved) and expert parallelism
(--enable-expert-parallel: four whole experts a rank), with and without biases; and the flag's
way from the command line and LLM(...) keywords to the worker. End to end, a tiny Qwen3-MoE's
greedy tokens through the multiprocess executor at TP=2, with and without expert parallelism,
equal one rank's.

Each rank is a spawned process that builds the layer, loads every expert's checkpoint-shaped
tensors by global id (the layer keeps its own part) and runs the same tokens.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from config.moe_arch import MoERouting
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.parallel import group

HIDDEN, INTER, EXPERTS, TOKENS = 32, 24, 8, 11

# name -> FusedMoE keywords and routing
CASES: dict[str, dict[str, Any]] = {
    "silu": {"routing": MoERouting(top_k=2)},
    # gpt-oss's experts: biases (the output bias must be added once over the ranks), clamped
    "swigluoai_bias": {
        "routing": MoERouting(top_k=4),
        "activation": "swigluoai",
        "bias": True,
        "swiglu_limit": 1.0,
    },
}


def _checkpoint(case: str) -> dict[tuple[str, int], torch.Tensor]:
    """Every expert's tensors as a checkpoint holds them, (name, expert) -> tensor."""
    gen = torch.Generator().manual_seed(len(case))
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    if CASES[case].get("bias"):
        shapes |= {"gate_bias": (INTER,), "up_bias": (INTER,), "down_bias": (HIDDEN,)}
    return {
        (name, e): torch.randn(shape, generator=gen) * 0.3
        for e in range(EXPERTS)
        for name, shape in shapes.items()
    }


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, EXPERTS, generator=gen)


def _run_layer(case: str) -> tuple[torch.Tensor, int, list[str]]:
    """(output, local experts, missing tensors) of the layer on this process's rank."""
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, **CASES[case])
    for (name, expert), tensor in _checkpoint(case).items():
        layer.load_expert(name, expert, tensor)
    x, logits = _inputs()
    return layer(x, logits), layer.num_local_experts, layer.missing()


COMBOS = [(case, ep) for case in CASES for ep in (False, True)]


def _rank_main(rank: int, init: str, results: Any) -> None:
    """Every combination on this rank, one group for all (spawning costs seconds a process)."""
    torch.set_num_threads(1)
    group.init_tensor_parallel(rank, 2, init, torch.device("cpu"), timeout_s=60)
    try:
        for case, expert_parallel in COMBOS:
            group.set_expert_parallel(expert_parallel)
            out, experts, missing = _run_layer(case)
            # As a numpy array: a tensor would travel as a handle to this process's shared
            # memory, gone once it exits.
            results.put((rank, case, expert_parallel, out.numpy(), experts, missing))
    finally:
        group.destroy_tensor_parallel()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, tuple]:
    """(rank, case, expert_parallel) -> (output, local experts, missing) from two ranks."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('gloo') / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_main, args=(rank, init, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(2 * len(COMBOS)):
            rank, case, expert_parallel, *rest = results.get(timeout=120)
            got[rank, case, expert_parallel] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return got


@pytest.mark.parametrize(("case", "expert_parallel"), COMBOS)
def test_two_ranks_equal_one(two_ranks: dict, case: str, expert_parallel: bool) -> None:
    expected, experts, missing = _run_layer(case)
    assert experts == EXPERTS and not missing
    for rank in range(2):
        out, local_experts, missing = two_ranks[rank, case, expert_parallel]
        # Expert parallelism holds half the experts whole; TP every expert, half of each.
        assert local_experts == (EXPERTS // 2 if expert_parallel else EXPERTS)
        assert not missing, f"rank {rank} reports unloaded tensors {missing[:3]}"
        torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-5, atol=1e-5)


def test_flag_from_the_command_line_and_keywords() -> None:
    import argparse

    from config.args import add_engine_args, engine_kwargs
    from config.engine import engine_config_from_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "enable_expert_parallel" not in engine_kwargs(parser.parse_args([]))
    kwargs = engine_kwargs(parser.parse_args(["--enable-expert-parallel", "-tp", "2"]))
    assert kwargs["enable_expert_parallel"] is True
    assert engine_config_from_kwargs(**kwargs).parallel.enable_expert_parallel
    assert not engine_config_from_kwargs().parallel.enable_expert_parallel


def test_worker_sets_expert_parallel_before_building_the_model() -> None:
    from engine_core.resolve import resolved_config
    from gpu_worker.worker import Worker

    config = resolved_config(device="cpu", load_format="dummy", enable_expert_parallel=True)
    try:
        Worker(config)
        assert group.expert_parallel()
    finally:
        group.set_expert_parallel(False)


def test_qwen3_moe_greedy_tokens_at_tp2_and_expert_parallel_equal_one_rank(
    tmp_path: Path,
) -> None:
    """End to end through the multiprocess executor: a tiny Qwen3-MoE (8 experts, top-2, the
    router scaled up so the choice of experts matters) gives one rank's greedy tokens at TP=2
    and at TP=2 with --enable-expert-parallel."""
    from safetensors.torch import load_file, save_file

    from protocol.sampling_params import SamplingParams
    from tests.tiny_models import make_tiny_model
    from tests.worker.runner_utils import make_runner, random_prompts, run_multiproc

    model_dir = make_tiny_model(
        tmp_path,
        "qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    weights = load_file(model_dir / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(".gate.weight"):
            weights[name] = 20.0 * t
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})

    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    prompts = random_prompts(512, (1, 9, 30))
    _, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    expected = driver.run(prompts, greedy, 6, chunk=16)
    for expert_parallel in (False, True):
        outputs, _ = run_multiproc(
            model_dir, prompts, greedy, 6, chunk=16, enable_expert_parallel=expert_parallel
        )
        assert outputs == expected, expert_parallel
