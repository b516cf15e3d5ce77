"""`engine serve -dp 2 --data-parallel-backend ray` on a two-node local Ray cluster (one CPU
each): one engine core per node, each in a Ray actor; streamed requests complete on both ranks
with one engine's greedy text; a killed actor fails its requests with 503 and the launcher
exits 1 naming the rank; a cluster too small is refused saying what is missing."""

from __future__ import annotations

import re

import pytest

from config.engine import engine_config_from_kwargs
from config.errors import ConfigError
from serve.data_parallel_plan import DataParallelPlan
from tests.dp.test_dp_serve import (
    PROMPTS,
    _args,
    _kill_mid_stream,
    assert_streams_share_both_engines,
)
from tests.serve.conftest import Server, pid_gone, tiny_model, wait_until  # noqa: F401

ray = pytest.importorskip("ray")

from tests.ray_cluster import actor_pids, cluster, process_table  # noqa: E402,F401

RAY_DP = ("--data-parallel-backend", "ray")


def test_too_small_a_cluster_is_refused_saying_what_is_missing(cluster, tiny_model):
    srv = Server(_args(tiny_model, "-dp", "3", *RAY_DP), env={"RAY_ADDRESS": cluster.address})
    assert not srv.ready
    assert srv.proc.wait(timeout=30) == 1
    assert re.search(
        r"engine serve: error: data_parallel_size 3 with tensor_parallel_size 1 "
        r"needs 3 bundles of 1 CPU \(one per engine core, one CPU per "
        r"tensor-parallel rank\); the Ray cluster has \d CPU free of 2 on 2 "
        r"node\(s\) \(node \w+ at [\d.]+: 1 CPU, node \w+ at [\d.]+: 1 CPU\)",
        srv.stderr,
    ), srv.stderr


@pytest.fixture(scope="module")
def server(cluster, tiny_model):
    before = set(actor_pids("EngineCoreActor"))
    srv = Server(_args(tiny_model, "-dp", "2", *RAY_DP), env={"RAY_ADDRESS": cluster.address})
    assert srv.ready and srv.api_url, srv.stderr
    srv.actors = {
        pid: raylet for pid, raylet in actor_pids("EngineCoreActor").items() if pid not in before
    }
    yield srv
    srv.stop()  # the kill test stops it first


def test_two_ray_actors_one_per_node_serve_both_ranks_like_one_engine(server, tiny_model):
    assert len(server.actors) == 2
    assert len(set(server.actors.values())) == 2, "one actor on each node (raylet)"
    assert_streams_share_both_engines(server, tiny_model, PROMPTS * 2)


def test_a_killed_actor_fails_its_requests_and_the_launcher_exits_1_naming_it(server):
    victim = max(server.actors)
    cores = [pid for pid, (ppid, _) in process_table().items() if ppid in server.actors]
    assert len(cores) == 2, "each actor runs its engine core as its child"
    results, took = _kill_mid_stream(server.api_url, victim)
    failed = [r for r in results if r[0] != 200]
    assert failed and all(status == 503 for status, _, _ in failed), results
    assert took < 10, took
    assert server.proc.wait(timeout=30) == 1, server.stderr
    assert re.search(
        r"engine serve: error: engine-core-\d \(pid \d+ on node \w+ at [\d.]+\): "
        r"its Ray actor died: The actor is dead because its worker process has "
        r"died",
        server.stderr,
    ), server.stderr
    # The other actor goes with the launcher, and both engine cores with their actors.
    assert wait_until(
        lambda: not actor_pids("EngineCoreActor").keys() & server.actors.keys(), timeout=15
    )
    assert wait_until(lambda: all(pid_gone(pid) for pid in cores), timeout=10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"data_parallel_backend": "ray", "distributed_executor_backend": "ray"},
            "distributed_executor_backend 'ray' inside it is not supported",
        ),
        ({"data_parallel_backend": "k8s"}, "data_parallel_backend must be one of mp, ray"),
    ],
)
def test_what_ray_placement_cannot_do_is_refused_in_the_config(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        engine_config_from_kwargs(model="m", **kwargs)


@pytest.mark.parametrize(
    "extra, headless",
    [
        ({"data_parallel_size_local": 1}, False),
        ({"data_parallel_start_rank": 1}, True),
        ({"data_parallel_rpc_port": 29551}, False),
        ({}, True),
    ],
)
def test_ray_placement_refuses_the_flags_of_hand_placed_ranks(extra, headless):
    args = {"data_parallel_size": 2, "data_parallel_backend": "ray", **extra}
    with pytest.raises(ValueError, match="--data-parallel-backend ray places every rank"):
        DataParallelPlan.from_args(args, headless)
