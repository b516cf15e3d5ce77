"""RayExecutor on a two-node local Ray cluster (two CPUs on the head node, where the engine core
runs, one on the other): tensor parallelism on the head node (both ranks read the engine core's
shared-memory ring) and across the nodes (one rank reads the ring, the other gets actor calls)
gives one device's greedy tokens, a killed worker actor fails the engine naming it (and, under
`engine serve`, its requests with 503 and the launcher with exit 1), and a cluster too small is
refused at start-up saying what is missing."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from engine_core.resolve import resolved_config
from executor.base import WorkerError
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.serve.conftest import Server, kill_mid_generation, pid_gone, wait_until
from tests.tiny_models import make_tiny_model_with_tokenizer

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from executor.ray_cluster import RayResourcesError
from executor.ray_executor import RayExecutor
from tests.ray_cluster import actor_pids, cluster_with_two_head_cpus  # noqa: F401

CPUS = 3  # two on the head node, one on the other

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
PROMPTS = [
    [1, 400, 401, 402],
    [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [1, 30000],
]


@pytest.fixture(scope="module")
def cluster(cluster_with_two_head_cpus):
    return cluster_with_two_head_cpus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """One device's greedy tokens."""
    one = _llm(model_dir)
    try:
        return _generate(one)
    finally:
        one.shutdown()


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        engine_process=False,
        device="cpu",
        max_model_len=256,
        kv_cache_memory="4MiB",
        **kwargs,
    )


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def _dead(rank: int) -> str:
    return (
        rf"^engine worker rank {rank} \(Ray actor, pid \d+ on node \w+ at [\d.]+\) died: "
        r"The actor is dead because its worker process has died;"
    )


def _head_node() -> str:
    return ray.get_runtime_context().get_node_id()


def test_tp2_on_the_engine_core_node_reads_the_ring_and_a_killed_reader_is_named(
    cluster, model_dir, expected
):
    llm = _llm(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.engine_core.executor
        assert {node_id for node_id, _, _ in executor.locations} == {_head_node()}
        assert executor.ring_ranks == [0, 1]
        submitted = []
        submit = executor.submit
        executor.submit = lambda step: submitted.append(submit(step)) or submitted[-1]
        assert _generate(llm) == expected
        # Every step reached both ranks through the ring, and none made an actor call. The
        # step's output comes from rank 0: rank 1 may still be on the last step for a moment.
        deadline = time.monotonic() + 10
        while True:
            steps = ray.get([actor.ring_steps.remote() for actor in executor.actors])
            if steps[0] == steps[1] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert steps[0] == steps[1] == len(submitted) >= GREEDY.max_tokens
        assert all(future.refs == {} for future in submitted)
        os.kill(executor.locations[1][2], signal.SIGKILL)
        with pytest.raises(WorkerError, match=_dead(1)):
            _generate(llm)
    finally:
        llm.shutdown()
    assert wait_until(lambda: ray.available_resources().get("CPU") == CPUS, timeout=10), (
        "the bundles should be given back"
    )


@ray.remote(num_cpus=1)
class _Holder:
    """Holds one CPU of a node."""

    def ready(self) -> bool:
        return True


def test_tp2_across_two_nodes_equals_tp1_and_a_killed_worker_is_named(cluster, model_dir, expected):
    # One of the head node's CPUs is taken, so that the ranks go to different nodes.
    holder = _Holder.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node(), soft=False)
    ).remote()
    ray.get(holder.ready.remote())
    llm = _llm(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.engine_core.executor
        assert isinstance(executor, RayExecutor)
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(nodes) == 2
        assert {node_id for node_id, _, _ in executor.locations} == nodes, (
            "the two ranks should run on different nodes"
        )
        assert executor.ring_ranks == [
            rank
            for rank, (node_id, _, _) in enumerate(executor.locations)
            if node_id == _head_node()
        ]
        assert len(executor.ring_ranks) == 1
        assert _generate(llm) == expected
        os.kill(executor.locations[1][2], signal.SIGKILL)
        with pytest.raises(WorkerError, match=_dead(1)):
            _generate(llm)
    finally:
        llm.shutdown()
        ray.kill(holder)
    # Ray frees a removed placement group's bundles a little later.
    assert wait_until(lambda: ray.available_resources().get("CPU") == CPUS, timeout=10), (
        "the bundles should be given back"
    )


def _config(model_dir, tp: int):
    return resolved_config(
        model=str(model_dir),
        device="cpu",
        kv_cache_memory="4MiB",
        tensor_parallel_size=tp,
        distributed_executor_backend="ray",
    )


def test_too_small_a_cluster_is_refused_saying_what_is_missing(cluster, tmp_path):
    four_kv_heads = make_tiny_model_with_tokenizer(tmp_path / "m", num_key_value_heads=4)
    start = time.monotonic()
    with pytest.raises(
        RayResourcesError,
        match=r"^tensor_parallel_size 4 needs 4 CPU bundles \(one CPU per rank\); "
        r"the Ray cluster has \d CPU free of 3 on 2 node\(s\) \(node \w+ "
        r"at [\d.]+: [12] CPU, node \w+ at [\d.]+: [12] CPU\)$",
    ):
        _llm(four_kv_heads, tensor_parallel_size=4, distributed_executor_backend="ray")
    assert time.monotonic() - start < 10, "a cluster that can never hold it is refused at once"


def test_bundles_held_elsewhere_are_awaited_then_refused(cluster, model_dir):
    taken = placement_group([{"CPU": 2}])  # the head node's two CPUs are busy elsewhere
    assert taken.wait(30)
    try:
        with pytest.raises(
            RayResourcesError,
            match=r"tensor_parallel_size 2 needs 2 CPU bundles "
            r"\(one CPU per rank\); the Ray cluster has 1 "
            r"CPU free of 3 .*; the bundles could not be "
            r"placed in 2 s$",
        ):
            RayExecutor(_config(model_dir, 2), placement_timeout_s=2).initialize()
    finally:
        remove_placement_group(taken)


def test_a_worker_failing_at_start_up_is_reported_and_its_bundles_freed(
    cluster, model_dir, tmp_path
):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    executor = RayExecutor(_config(broken, 2))
    with pytest.raises(
        WorkerError,
        match=r"engine worker rank \d \(Ray actor, pid \d+ on node "
        r"\w+ at [\d.]+\) failed:\n"
        r"ray::EngineWorker.load_model\(\)(.|\n)*"
        r"cannot read safetensors file",
    ):
        executor.initialize()
    assert not executor.actors
    assert wait_until(lambda: ray.available_resources().get("CPU") == CPUS, timeout=10)


def test_serve_with_ray_workers_fails_requests_and_exits_1_when_one_is_killed(
    cluster, model_dir, monkeypatch
):
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # the engine core joins this cluster
    before = set(actor_pids("EngineWorker"))
    server = Server(
        [
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
        ]
    )
    try:
        assert server.ready, server.stderr
        workers = set(actor_pids("EngineWorker")) - before
        assert len(workers) == 2
        error = kill_mid_generation(server, max(workers))
        assert error.status == 503
        assert re.search(r"engine worker rank \d \(Ray actor, pid \d+ .*\) died", str(error))
        assert server.proc.wait(timeout=30) == 1, server.stderr
        assert "engine-core" in server.stderr
        assert wait_until(lambda: all(pid_gone(pid) for pid in workers), timeout=10)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
