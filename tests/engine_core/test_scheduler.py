from __future__ import annotations

import random

import pytest

from engine_core.request import Request, RequestStatus
from engine_core.request_queue import PriorityQueue
from protocol.engine_core import FinishReason
from protocol.sampling_params import SamplingParams
from tests.engine_core.utils import (
    EOS,
    SAMPLED,
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def test_budget_and_max_num_seqs_hold_under_random_arrivals() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=200, max_num_seqs=5, max_num_batched_tokens=48)
    runner = FakeRunner(sched)
    for i in range(300):
        if i < 200 and rng.random() < 0.4:
            sched.add_request(
                make_request(f"r{i}", rng.randint(1, 90), max_tokens=rng.randint(1, 20))
            )
        so, _ = step(sched, runner)
        assert so.total_num_scheduled_tokens <= 48
        assert len(so.num_scheduled_tokens) <= 5 and len(sched.running) <= 5
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 200


def test_long_prompt_is_chunked_and_running_requests_go_first() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("long", 40))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"long": 16} and outs == {}
    sched.add_request(make_request("short", 12))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"long": 16} and outs == {}
    assert so.scheduled_cached_reqs.num_computed_tokens == [16]
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("long", 8), ("short", 8)]
    assert outs["long"].new_token_ids == [SAMPLED] and "short" not in outs
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("long", 1), ("short", 4)]
    assert set(outs) == {"long", "short"}


def test_prompt_never_runs_past_max_model_len() -> None:
    sched = make_scheduler(max_model_len=20)
    with pytest.raises(ValueError):
        sched.add_request(make_request("too-long", 21))
    sched.add_request(make_request("a", 18, max_tokens=100))
    tokens = run_to_completion(sched, FakeRunner(sched))
    assert len(tokens["a"]) == 2  # 18 + 2 reaches max_model_len


def test_preemption_takes_the_latest_started_and_resumes_it_first() -> None:
    sched = make_scheduler(num_blocks=4, block_size=8, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    for name, max_tokens in (("a", 3), ("b", 3), ("c", 5)):
        sched.add_request(make_request(name, [ord(name)] * 8, max_tokens=max_tokens))
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b", "c"]
    sched.add_request(make_request("d", [7] * 4))
    # Every request needs a second block for token 9; one block is free, so c is preempted.
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["a", "b"] and so.finished_req_ids == ["c"]
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert sched.waiting.peek() is c and c.num_preemptions == 1
    assert sched.make_stats().num_preemptions == 1 and set(outs) == {"a", "b"}
    while True:
        so, outs = step(sched, runner)
        if so.scheduled_new_reqs:
            break
    resumed = so.scheduled_new_reqs[0]
    assert resumed.req_id == "c" and resumed.output_token_ids == [SAMPLED]
    assert resumed.prompt_token_ids == [ord("c")] * 8
    assert list(so.num_scheduled_tokens) == ["c", "d"]  # c went back to the front of the queue
    assert outs["c"].new_token_ids == [SAMPLED]
    rest = run_to_completion(sched, runner)
    assert len(rest["c"]) == 3 and rest["d"]
    assert sched.kv.num_free_blocks == 4


def test_priority_policy_orders_admission_and_preemption() -> None:
    sched = make_scheduler(num_blocks=3, block_size=8, max_num_seqs=2, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_request("low", [1] * 8, priority=5, arrival_time=1.0))
    sched.add_request(make_request("high", [2] * 8, priority=0, arrival_time=2.0))
    sched.add_request(make_request("mid", [3] * 8, priority=1, arrival_time=3.0))
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high", "mid"]
    sched.finish_requests("mid", RequestStatus.FINISHED_ABORTED)
    so, _ = step(sched, runner)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["low"] and so.finished_req_ids == ["mid"]
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 3


def test_priority_victim_scheduled_earlier_in_the_step_is_taken_back() -> None:
    sched = make_scheduler(num_blocks=3, block_size=8, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_request("low", 14, priority=9, max_tokens=8))
    step(sched, runner)
    sched.add_request(make_request("high", 8, priority=0, max_tokens=8))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["low", "high"]
    # low completes its second block and is scheduled first; high then finds no block, and
    # the lowest priority running request is low: its share of the step is withdrawn.
    low = sched.requests["low"]
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"high": 1} and so.finished_req_ids == ["low"]
    assert so.scheduled_cached_reqs.req_ids == ["high"] and set(outs) == {"high"}
    assert so.total_num_scheduled_tokens == 1
    assert low.status == RequestStatus.PREEMPTED
    # Its second block was never computed, so it must not stay in the prefix cache.
    assert sched.kv.pool.get_cached_block(low.block_hashes[1]) is None
    assert sched.kv.pool.get_cached_block(low.block_hashes[0]) is not None
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 3


def test_stop_conditions() -> None:
    outputs_of = {
        "eos": [5, 5, EOS, 5],
        "ignore": [EOS, EOS, 5, 5],
        "stop": [5, 9, 5],
        "min": [EOS, 9, 9, 5],
        "max": [5] * 10,
        "len": [5] * 50,
    }
    sched = make_scheduler(max_model_len=16)
    runner = FakeRunner(sched, sample=lambda req_id, n: outputs_of[req_id][n])
    sched.add_request(make_request("eos", 4))
    sched.add_request(make_request("ignore", 4, ignore_eos=True, max_tokens=3))
    sched.add_request(make_request("stop", 4, stop_token_ids=[9]))
    sched.add_request(make_request("min", 4, stop_token_ids=[9], min_tokens=3))
    sched.add_request(make_request("max", 4, max_tokens=4))
    sched.add_request(make_request("len", 10, max_tokens=None))
    finals, tokens = {}, {}
    while sched.has_unfinished_requests():
        _, outs = step(sched, runner)
        for req_id, out in outs.items():
            tokens.setdefault(req_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[req_id] = (out.finish_reason, out.stop_reason)
    assert finals == {
        "eos": (FinishReason.STOP, None),
        "ignore": (FinishReason.LENGTH, None),
        "stop": (FinishReason.STOP, 9),
        "min": (FinishReason.STOP, 9),
        "max": (FinishReason.LENGTH, None),
        "len": (FinishReason.LENGTH, None),
    }
    assert tokens == {
        "eos": [5, 5, EOS],
        "ignore": [EOS, EOS, 5],
        "stop": [5, 9],
        "min": [EOS, 9, 9],
        "max": [5] * 4,
        "len": [5] * 6,
    }
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_priority_queue_breaks_ties_by_arrival_and_puts_preempted_first() -> None:
    def req(name: str, priority: int, arrival: float) -> Request:
        return Request(name, [1], SamplingParams(), None, arrival_time=arrival, priority=priority)

    queue = PriorityQueue()
    for r in (req("late", 1, 2.0), req("early", 1, 1.0), req("urgent", 0, 3.0)):
        queue.add(r)
    queue.add_preempted(req("back", 1, 1.0))
    assert [queue.pop().request_id for _ in range(4)] == ["urgent", "back", "early", "late"]
