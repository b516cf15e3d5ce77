"""Async scheduling in the scheduler: step N+1 is scheduled before step N's tokens are applied.

The fake runner runs each step when it is handed over, as the real worker runs steps in the
order they are submitted; the engine applies a step's output only after scheduling the next.
Its sampler is a function of (request, position), so any correct schedule gives every request
the same tokens: async scheduling must give exactly the synchronous results.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine_core.request import RequestStatus
from engine_core.scheduler import Scheduler
from tests.engine_core.test_scheduler_random import check_invariants
from tests.engine_core.utils import EOS, FakeRunner, make_request, make_scheduler


def _sampler(req_id: str, num_outputs: int) -> int:
    r = random.Random(f"{req_id}/{num_outputs}").random()
    return EOS if r < 0.04 else 5 + int(r * 4)


def _drive(
    sched: Scheduler, runner: FakeRunner, overlapped: bool, on_step=None, max_steps: int = 5000
) -> dict[str, tuple[list[int], str]]:
    """Run to completion as EngineCore does (overlapped: two steps in flight); returns each
    request's tokens and finish reason."""
    in_flight: deque = deque()
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], str]] = {}
    for _ in range(max_steps):
        work = sched.has_unfinished_requests() or sched.has_finished_requests()
        if not work and not in_flight:
            return done
        if work and len(in_flight) < (2 if overlapped else 1):
            so = sched.schedule()
            if so.total_num_scheduled_tokens or so.finished_req_ids or not in_flight:
                in_flight.append((so, runner.execute(so)))
                if overlapped and len(in_flight) == 1 and so.total_num_scheduled_tokens:
                    continue
        so, out = in_flight.popleft()
        for o in sched.update_from_output(so, out):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = (tokens.pop(o.request_id, []), o.finish_reason.name)
        check_invariants(sched)
        if on_step is not None:
            on_step(sched, in_flight)
    raise AssertionError("requests did not finish")


def _workload(rng: random.Random, n: int) -> list:
    reqs = []
    for i in range(n):
        params = {"max_tokens": rng.randint(1, 24)}
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.choice([6, 7])]
            params["min_tokens"] = rng.randint(0, params["max_tokens"])
        if rng.random() < 0.2:
            params["ignore_eos"] = True
        prefix = list(range(500, 516)) if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(10, 50) for _ in range(rng.randint(1, 40))]
        reqs.append(make_request(f"r{i}", prompt, arrival_time=float(i), **params))
    return reqs


@pytest.mark.parametrize("seed", range(6))
def test_async_gives_exactly_the_synchronous_tokens(seed: int) -> None:
    rng = random.Random(seed)
    shape = dict(
        num_blocks=rng.choice([14, 24, 64]),
        block_size=8,
        max_num_seqs=rng.choice([3, 8]),
        max_num_batched_tokens=rng.choice([16, 48]),
        max_model_len=72,
        enable_prefix_caching=seed % 3 != 2,
    )
    workload = _workload(rng, 30)
    results = {}
    for overlapped in (False, True):
        sched = make_scheduler(**shape, async_scheduling=overlapped)
        runner = FakeRunner(sched, sample=_sampler)
        for req in workload:
            sched.add_request(req)
        results[overlapped] = _drive(sched, runner, overlapped)
        assert sched.kv.num_free_blocks == shape["num_blocks"]
        _drive_empty_step(sched, runner)
        assert not runner.rows, "the runner must have been told of every finished request"
    assert results[True] == results[False]
    assert len(results[True]) == len(workload)


def _drive_empty_step(sched: Scheduler, runner: FakeRunner) -> None:
    """Deliver the finished ids left from the last step, as the next step would."""
    runner.execute(sched.schedule())


def test_preemption_with_a_step_in_flight_discards_that_token() -> None:
    # Three requests of 16 + 30 tokens share 12 blocks of 8 (each needs 6 at the end): the
    # newest is preempted while a step that includes it is in flight, and its resumed run must
    # not see that step's token twice.
    shape = dict(
        num_blocks=12,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    reqs = [make_request(f"long{i}", 16, max_tokens=30, ignore_eos=True) for i in range(3)]
    results = {}
    for overlapped in (False, True):
        sched = make_scheduler(**shape, async_scheduling=overlapped)
        for req in reqs:
            sched.add_request(req)
        results[overlapped] = _drive(sched, FakeRunner(sched, sample=_sampler), overlapped)
        assert sched.make_stats().num_preemptions > 0, "the blocks should force preemption"
    assert results[True] == results[False]
    assert all(len(tokens) == 30 for tokens, _ in results[True].values())


def test_length_capped_requests_are_not_scheduled_past_their_last_token() -> None:
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 10, max_tokens=5, ignore_eos=True))
    scheduled: list[int] = []
    depths: list[int] = []

    def record(s, in_flight):
        depths.append(len(in_flight))

    runner = FakeRunner(sched, sample=lambda req_id, n: 5)
    original = runner.execute

    def counting(so):
        scheduled.append(so.num_scheduled_tokens.get("a", 0))
        return original(so)

    runner.execute = counting
    done = _drive(sched, runner, overlapped=True, on_step=record)
    assert done == {"a": ([5] * 5, "LENGTH")}
    # The prompt, then one position per further token: nothing computed for a 6th token.
    assert [n for n in scheduled if n] == [10, 1, 1, 1, 1]
    assert 1 in depths, "a step should be in flight while the previous one is applied"


def test_a_stop_token_costs_one_thrown_away_step() -> None:
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 6, max_tokens=50))
    runner = FakeRunner(sched, sample=lambda req_id, n: EOS if n == 3 else 5)
    done = _drive(sched, runner, overlapped=True)
    assert done == {"a": ([5, 5, 5, EOS], "STOP")}
    # The step after the EOS was already computing a 5th token; it is dropped, and the runner
    # is told the request ended.
    _drive_empty_step(sched, runner)
    assert not runner.rows and sched.kv.num_free_blocks == 64


def test_priority_victim_sitting_the_step_out_is_preempted_with_nothing_to_take_back() -> None:
    # low started first and has its last token in flight, so it sits the step out; high,
    # after it, needs a block, and the priority policy preempts low, which has no record.
    sched = make_scheduler(num_blocks=2, block_size=8, policy="priority", async_scheduling=True)
    runner = FakeRunner(sched, sample=lambda req_id, n: 5)
    sched.add_request(make_request("low", 8, priority=9, max_tokens=1, arrival_time=1.0))
    in_flight = [runner.execute(so1 := sched.schedule())]
    sched.add_request(make_request("high", 8, priority=0, max_tokens=4, arrival_time=2.0))
    in_flight.append(runner.execute(so2 := sched.schedule()))
    assert list(so2.num_scheduled_tokens) == ["high"] and sched.kv.num_free_blocks == 0
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"high": 1} and so3.finished_req_ids == ["low"]
    assert so3.total_num_scheduled_tokens == 1
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    in_flight.append(runner.execute(so3))
    tokens: dict[str, list[int]] = {}
    for so, out in zip((so1, so2, so3), in_flight):
        for o in sched.update_from_output(so, out):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == {"high": [5, 5]}  # low's token in flight was thrown away
    done = _drive(sched, runner, overlapped=True)
    assert done["low"] == ([5], "LENGTH")  # recomputed once high finished
    assert tokens["high"] + done["high"][0] == [5] * 4 and done["high"][1] == "LENGTH"
    assert sched.kv.num_free_blocks == 2


@pytest.mark.parametrize("seed", range(4))
def test_random_aborts_with_steps_in_flight_return_every_block(seed: int) -> None:
    rng = random.Random(100 + seed)
    num_blocks = rng.choice([12, 24])
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=rng.choice([16, 48]),
        max_model_len=96,
        enable_prefix_caching=seed % 2 == 0,
        async_scheduling=True,
    )
    runner = FakeRunner(sched, sample=_sampler)
    pending = _workload(rng, 40)
    finished = 0

    def churn(s, in_flight):
        nonlocal finished
        if pending and rng.random() < 0.4:
            s.add_request(pending.pop())
        if s.requests and rng.random() < 0.15:
            s.finish_requests(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)

    for req in [pending.pop() for _ in range(5)]:
        sched.add_request(req)
    done = _drive(sched, runner, overlapped=True, on_step=churn)
    while pending:  # the churn stopped when the queue emptied: run what it did not submit
        sched.add_request(pending.pop())
        done.update(_drive(sched, runner, overlapped=True))
    assert len(done) == 40
    assert sched.kv.num_free_blocks == num_blocks and sched.kv.usage == 0.0
    _drive_empty_step(sched, runner)
    assert not runner.rows
    assert sched.reset_prefix_cache()
