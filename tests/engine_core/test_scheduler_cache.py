from __future__ import annotations

from engine_core.request import RequestStatus
from protocol.engine_core import FinishReason
from tests.engine_core.utils import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

PREFIX = list(range(1000, 1032))  # four blocks of 8


def test_shared_prefix_is_served_from_the_cache() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", PREFIX + [1, 2, 3], max_tokens=4))
    step(sched, runner)
    sched.make_stats()
    sched.add_request(make_request("b", PREFIX + [7, 8], max_tokens=4))
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens["b"] == 2
    a_blocks, b_blocks = sched.kv.req_to_blocks["a"], sched.kv.req_to_blocks["b"]
    assert a_blocks[:4] == b_blocks[:4] and all(b.ref_cnt == 2 for b in b_blocks[:4])
    assert outs["b"].num_cached_tokens == 32
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 32)
    # vLLM's prompt_tokens: every prompt token, the cached ones too.
    assert stats.num_prompt_tokens == 34 and stats.num_generation_tokens == 2
    assert stats.num_cached_prompt_tokens == 32
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 64


def test_full_prompt_hit_recomputes_the_last_block() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", PREFIX, max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", PREFIX, max_tokens=1))
    so, outs = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    assert so.num_scheduled_tokens == {"b": 8} and outs["b"].num_cached_tokens == 24


def test_requests_arriving_together_share_blocks_computed_in_the_same_step() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)  # its simulated KV fails if b reads blocks a never wrote
    sched.add_request(make_request("a", PREFIX + [1]))
    sched.add_request(make_request("b", PREFIX + [2]))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 33, "b": 1}
    run_to_completion(sched, runner)


def test_cache_salt_separates_tenants() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", PREFIX + [1], cache_salt="alice"))
    step(sched, runner)
    sched.add_request(make_request("b", PREFIX + [1], cache_salt="bob"))
    sched.add_request(make_request("c", PREFIX + [1], cache_salt="alice"))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 33, "c": 1}


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=6, block_size=8, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 24, max_tokens=8))
    sched.add_request(make_request("b", 16, max_tokens=3))
    step(sched, runner)  # a: 3 blocks, b: 2 blocks, 1 free
    so, _ = step(sched, runner)  # a takes the free block, so b, needing a third, is preempted
    assert so.finished_req_ids == ["b"] and sched.requests["b"].num_preemptions == 1
    while not so.scheduled_new_reqs:
        so, _ = step(sched, runner)
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.num_computed_tokens == 16
    assert so.num_scheduled_tokens["b"] == 1
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 6


def test_reset_prefix_cache_refuses_while_requests_hold_blocks() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", PREFIX + [1], max_tokens=3))
    step(sched, runner)
    assert not sched.reset_prefix_cache()
    run_to_completion(sched, runner)
    assert sched.reset_prefix_cache()
    sched.add_request(make_request("b", PREFIX + [1]))
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_abort_frees_blocks_at_once_and_reaches_the_runner() -> None:
    sched = make_scheduler(block_size=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("run", 20))
    step(sched, runner)
    sched.add_request(make_request("wait", 20))
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 64 and not sched.has_unfinished_requests()
    assert sched.has_finished_requests()
    so, outs = step(sched, runner)
    assert sorted(so.finished_req_ids) == ["run", "wait"] and not runner.rows
    assert {k: o.finish_reason for k, o in outs.items()} == {
        "run": FinishReason.ABORT,
        "wait": FinishReason.ABORT,
    }
    assert not sched.has_finished_requests()
