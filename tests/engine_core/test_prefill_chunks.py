"""EngineCoreOutput.prefill_chunks: when and in what pieces the scheduler ran a prompt."""

from __future__ import annotations

import time

from tests.engine_core.utils import FakeRunner, make_request, make_scheduler, step


def test_chunks_of_a_prompt_come_with_its_first_output_only() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    start = time.time()
    sched.add_request(make_request("long", 40))
    outs: dict = {}
    while "long" not in outs:
        _, outs = step(sched, runner)
    chunks = outs["long"].prefill_chunks
    assert [n for _, n in chunks] == [16, 16, 8]
    times = [t for t, _ in chunks]
    assert start <= times[0] and times == sorted(times) and times[-1] <= time.time()
    _, outs = step(sched, runner)
    assert outs["long"].new_token_ids and outs["long"].prefill_chunks == []


def test_a_prefix_hit_leaves_one_chunk_of_the_uncached_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, block_size=8)
    runner = FakeRunner(sched)
    prompt = list(range(100, 124))
    sched.add_request(make_request("a", prompt))
    _, outs = step(sched, runner)
    assert [n for _, n in outs["a"].prefill_chunks] == [24]
    sched.add_request(make_request("b", prompt))
    _, outs = step(sched, runner)
    cached = outs["b"].num_cached_tokens
    assert cached > 0 and [n for _, n in outs["b"].prefill_chunks] == [24 - cached]
