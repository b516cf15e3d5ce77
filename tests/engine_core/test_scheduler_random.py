from __future__ import annotations

import random
from collections import Counter

import pytest

from engine_core.request import RequestStatus
from engine_core.scheduler import Scheduler
from tests.engine_core.utils import EOS, FakeRunner, make_request, make_scheduler, step

PREFIXES = [[], list(range(500, 516)), list(range(600, 624)), list(range(500, 508))]


def check_invariants(sched: Scheduler) -> None:
    """Block refcounts, the free queue, the cache map and the queues agree with each other."""
    kv, pool = sched.kv, sched.kv.pool
    null = pool.null_block  # entries freed behind a sliding window
    holders = Counter(
        b.block_id for blocks in kv.req_to_blocks.values() for b in blocks if b is not null
    )
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in pool.blocks)
    assert all(pool.blocks[i].ref_cnt == 0 for i in free_ids)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running}
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    assert len(sched.running) <= sched.max_num_seqs
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING and sched.requests[req.request_id] is req
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
        assert 0 <= req.num_output_placeholders <= 2  # at most two steps in flight
        assert len(kv.req_to_blocks[req.request_id]) * kv.block_size >= req.num_computed_tokens


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_return_every_block(seed: int) -> None:
    rng = random.Random(seed)
    policy = "priority" if seed % 2 else "fcfs"
    num_blocks = rng.choice([12, 20, 40])
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=8,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 24, 64]),
        max_model_len=96,
        enable_prefix_caching=seed % 4 != 3,
        policy=policy,
        hash_algo=rng.choice(["sha256", "builtin"]),
    )
    runner = FakeRunner(
        sched, sample=lambda req_id, n: EOS if rng.random() < 0.05 else rng.choice([5, 6, 7, 8])
    )
    submitted = finished = aborted = 0
    for i in range(400):
        if i < 300 and rng.random() < 0.3:
            suffix = [rng.randrange(10, 50) for _ in range(rng.randint(1, 40))]
            prompt = rng.choice(PREFIXES) + suffix
            params = {"max_tokens": rng.randint(1, 30)}
            if rng.random() < 0.2:
                params["stop_token_ids"] = [rng.choice([6, 7])]
                params["min_tokens"] = rng.randint(0, params["max_tokens"])
            if rng.random() < 0.1:
                params["ignore_eos"] = True
            sched.add_request(
                make_request(
                    f"r{i}",
                    prompt[:95],
                    priority=rng.randint(0, 3),
                    arrival_time=float(i),
                    **params,
                )
            )
            submitted += 1
        if sched.requests and rng.random() < 0.08:
            victim = rng.choice(list(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests() and not sched.has_finished_requests():
            continue
        _, outs = step(sched, runner)
        for out in outs.values():
            if out.finished:
                finished += 1
                aborted += out.finish_reason.name == "ABORT"
        check_invariants(sched)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        _, outs = step(sched, runner)
        finished += sum(o.finished for o in outs.values())
        check_invariants(sched)
    assert not sched.has_unfinished_requests() and finished == submitted
    assert sched.kv.num_free_blocks == num_blocks and sched.kv.usage == 0.0
    step(sched, runner)  # delivers the last finished ids
    assert not runner.rows
    assert sched.reset_prefix_cache()
