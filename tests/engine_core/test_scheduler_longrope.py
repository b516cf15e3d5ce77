"""The scheduler's LongRoPE choice (long_rope_threshold): a prompt beyond the original context
starts long, a request whose step would pass it is recomputed from scratch flagged long (as
transformers' Phi-3 generate() re-encodes), and the prefix cache keeps short and long KV apart.
The FakeRunner checks the step contract (a resent request starts over, every read block was
computed)."""

from __future__ import annotations

import pytest

from tests.engine_core.utils import FakeRunner, make_request, make_scheduler, step

ORIGINAL = 32  # the original context the tests set


def _scheduler(**kwargs):
    sched = make_scheduler(block_size=8, **kwargs)
    sched.long_rope_at = ORIGINAL  # what config.arch's LongRoPE scaling would give
    return sched, FakeRunner(sched)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_crossing_the_original_context_is_recomputed_long(async_scheduling):
    sched, runner = _scheduler(async_scheduling=async_scheduling)
    prompt = list(range(100, 124))  # 24 tokens: short until its tokens pass 32
    sched.add_request(make_request("a", prompt, max_tokens=10))
    sent = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        sent.extend(so.scheduled_new_reqs)
    req_starts = [(n.rope_long, n.num_computed_tokens, len(n.output_token_ids)) for n in sent]
    # The step computing the 33rd token (position 32) is the first past 32: resent with its 9
    # outputs, from position 0.
    assert req_starts == [(False, 0, 0), (True, 0, ORIGINAL + 1 - len(prompt))]
    assert sched.make_stats().num_preemptions == 0  # a switch, not a block shortage
    assert sched.kv.num_free_blocks == 64


def test_a_prompt_beyond_the_original_context_starts_long():
    sched, runner = _scheduler()
    sched.add_request(make_request("a", list(range(100, 140)), max_tokens=3))
    so, _ = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.rope_long and sched.requests["a"].rope_long


def test_the_prefix_cache_keeps_short_and_long_blocks_apart():
    sched, runner = _scheduler()
    prompt = list(range(100, 124))
    sched.add_request(make_request("short", prompt + [1], max_tokens=1))
    step(sched, runner)
    # Another short request with the same prefix shares its blocks ...
    sched.add_request(make_request("short2", prompt + [2], max_tokens=1))
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    # ... a long one (the same first 24 tokens, a prompt beyond 32) does not.
    sched.add_request(make_request("long", prompt + list(range(200, 216)), max_tokens=1))
    so, _ = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.rope_long and new.num_computed_tokens == 0
