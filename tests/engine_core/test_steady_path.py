"""The scheduler's steady decode path against its full per-request path.

A running request whose step needs nothing from the KV cache manager (its blocks have room, no
block completes: total <= Request.alloc_limit) and whose sampled token can end nothing (below
Request.check_at, not in Request.stop_check_ids) skips allocate_slots and the stop checks. These
tests put requests at each edge of that path inside a batch of steady ones, and compare whole
runs with the path disabled (every request through the full checks every step).
"""

from __future__ import annotations

import random
from collections import deque

import msgspec
import pytest

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import RequestStatus
from engine_core.scheduler import _UNKNOWN, Scheduler
from protocol.step import SchedulerOutput
from tests.engine_core.test_scheduler_random import check_invariants
from tests.engine_core.utils import (
    EOS,
    SAMPLED,
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def _steady_batch(sched: Scheduler, n: int = 6, prompt_len: int = 5, **params) -> None:
    for i in range(n):
        sched.add_request(make_request(f"s{i}", prompt_len, max_tokens=40, **params))


def test_eos_inside_a_steady_batch_ends_only_that_request() -> None:
    sched = make_scheduler(block_size=8)
    _steady_batch(sched)
    sched.add_request(make_request("eos", 5, max_tokens=40))
    runner = FakeRunner(sched, sample=lambda rid, n: EOS if rid == "eos" and n == 10 else SAMPLED)
    for _ in range(10):  # prefill, then 9 decodes: every request is on the steady path
        step(sched, runner)
    assert len(sched.running) == 7
    so, outs = step(sched, runner)
    assert outs["eos"].new_token_ids == [EOS] and outs["eos"].finish_reason.name == "STOP"
    assert all(not outs[f"s{i}"].finished for i in range(6))
    assert [r.request_id for r in sched.running] == [f"s{i}" for i in range(6)]
    assert "eos" not in sched.kv.req_to_blocks
    so, _ = step(sched, runner)
    assert so.finished_req_ids == ["eos"] and "eos" not in so.num_scheduled_tokens
    check_invariants(sched)


def test_eos_is_ignored_with_ignore_eos_and_before_min_tokens() -> None:
    sched = make_scheduler(block_size=8)
    sched.add_request(make_request("ign", 5, max_tokens=12, ignore_eos=True))
    sched.add_request(make_request("min", 5, max_tokens=12, min_tokens=6))
    runner = FakeRunner(sched, sample=lambda rid, n: EOS if n in (3, 7) else SAMPLED)
    tokens = run_to_completion(sched, runner)
    assert len(tokens["ign"]) == 12  # length-capped, through two EOS
    assert len(tokens["min"]) == 8 and tokens["min"][-1] == EOS  # the EOS after min_tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 8, 9, 16, 17])
def test_max_tokens_ends_the_request_exactly(max_tokens: int) -> None:
    sched = make_scheduler(block_size=8)
    _steady_batch(sched)
    sched.add_request(make_request("cap", 7, max_tokens=max_tokens))
    runner = FakeRunner(sched)
    tokens: list[int] = []
    for _ in range(max_tokens):
        _, outs = step(sched, runner)
        tokens += outs["cap"].new_token_ids
        assert all(not outs[f"s{i}"].finished for i in range(6))
    assert len(tokens) == max_tokens and outs["cap"].finish_reason.name == "LENGTH"
    assert "cap" not in sched.requests and len(sched.running) == 6


def test_max_tokens_and_max_model_len_length_caps() -> None:
    sched = make_scheduler(block_size=8, max_model_len=30)
    sched.add_request(make_request("len", 20, max_tokens=100))
    sched.add_request(make_request("cap", 20, max_tokens=9))
    sched.add_request(make_request("none", 25, max_tokens=None))
    tokens = run_to_completion(sched, FakeRunner(sched))
    assert len(tokens["len"]) == 10 and len(tokens["cap"]) == 9 and len(tokens["none"]) == 5


def test_stop_token_inside_a_steady_batch_sets_stop_reason() -> None:
    sched = make_scheduler(block_size=8)
    _steady_batch(sched, stop_token_ids=[7])
    sched.add_request(make_request("stop", 5, max_tokens=40, stop_token_ids=[7], min_tokens=4))
    runner = FakeRunner(
        sched, sample=lambda rid, n: 7 if rid == "stop" and n in (2, 11) else SAMPLED
    )
    outs_by_req: dict = {}
    for _ in range(14):
        _, outs = step(sched, runner)
        for rid, out in outs.items():
            outs_by_req.setdefault(rid, []).append(out)
    last = outs_by_req["stop"][-1]
    assert last.finish_reason.name == "STOP" and last.stop_reason == 7
    assert sum(len(o.new_token_ids) for o in outs_by_req["stop"]) == 12  # the 7 at 3 was early
    assert all(not o.finished for rid in outs_by_req if rid != "stop" for o in outs_by_req[rid])


@pytest.mark.parametrize("caching", [True, False])
def test_block_boundaries_allocate_exactly_when_crossed(caching: bool) -> None:
    bs = 8
    sched = make_scheduler(block_size=bs, enable_prefix_caching=caching)
    sched.add_request(make_request("a", 6, max_tokens=30))
    sched.add_request(make_request("b", 8, max_tokens=30))
    runner = FakeRunner(sched)  # asserts every write has a block and no slot is shared
    calls = []
    original = sched.kv.allocate_slots

    def allocate(req, n, *args):
        calls.append((req.request_id, req.num_computed_tokens + n))
        return original(req, n, *args)

    sched.kv.allocate_slots = allocate  # type: ignore[method-assign]
    for _ in range(26):
        so, _ = step(sched, runner)
        for rid, blocks in zip(
            so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids
        ):
            req = sched.requests[rid]
            total = req.num_computed_tokens
            # A block arrives exactly when a step's token is the first of a block.
            assert bool(blocks) == (total % bs == 1), (rid, total, blocks)
            assert len(sched.kv.req_to_blocks[rid]) == -(-total // bs)
    decode_calls = [c for c in calls if c[1] > 8]
    # The manager is consulted only at block edges: a new block (total % bs == 1) and, with
    # prefix caching, the step that fills one (total % bs == 0, to cache it).
    edges = {1, 0} if caching else {1}
    assert decode_calls and all(total % bs in edges for _, total in decode_calls)


def test_full_blocks_are_hashed_and_cached_as_decodes_fill_them() -> None:
    bs = 8
    sched = make_scheduler(block_size=bs)
    _steady_batch(sched, n=3)
    sched.add_request(make_request("a", 5, max_tokens=40))
    runner = FakeRunner(sched, sample=lambda rid, n: 10 + n % 7)
    for _ in range(20):
        step(sched, runner)
        req = sched.requests["a"]
        assert len(req.block_hashes) == req.num_tokens // bs
        # Blocks whose tokens were all computed are in the prefix cache under those hashes.
        num_full = req.num_computed_tokens // bs
        blocks = sched.kv.req_to_blocks["a"]
        for i in range(num_full):
            assert sched.kv.pool.cached.get(req.block_hashes[i]) is blocks[i]
    # A request with a's tokens so far hits every full block.
    a = sched.requests["a"]
    twin = make_request("twin", list(a.all_token_ids), max_tokens=1)
    sched.add_request(twin)
    so, _ = step(sched, runner)
    twin_req = sched.requests.get("twin")
    hit = (len(a.all_token_ids) - 1) // bs * bs
    assert twin_req is None or twin_req.num_cached_tokens == hit
    assert so.scheduled_new_reqs[0].num_computed_tokens == hit


def test_preemption_of_steady_requests_resumes_them_with_the_same_tokens() -> None:
    def sample(rid: str, n: int) -> int:
        return 10 + (hash(rid) + n) % 5

    def run(num_blocks: int) -> tuple[dict, int]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_seqs=8)
        for i in range(6):
            sched.add_request(make_request(f"r{i}", 10, max_tokens=30))
        runner = FakeRunner(sched, sample=sample)
        preemptions = 0
        tokens: dict = {}
        for _ in range(400):
            if not sched.has_unfinished_requests():
                break
            _, outs = step(sched, runner)
            preemptions += sched.make_stats().num_preemptions
            for rid, out in outs.items():
                tokens.setdefault(rid, []).extend(out.new_token_ids)
            check_invariants(sched)
        return tokens, preemptions

    roomy, none = run(64)
    tight, some = run(16)
    assert none == 0 and some > 0
    assert tight == roomy


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_in_the_steady_set(async_scheduling: bool) -> None:
    sched = make_scheduler(block_size=8, async_scheduling=async_scheduling)
    _steady_batch(sched)
    runner = FakeRunner(sched)
    in_flight: deque = deque()
    outputs: dict = {}
    for i in range(30):
        so = sched.schedule()
        in_flight.append((so, runner.execute(so)))
        if async_scheduling and len(in_flight) < 2:
            continue
        if i == 12:
            sched.finish_requests("s2", RequestStatus.FINISHED_ABORTED)
            assert "s2" not in sched.kv.req_to_blocks
        so, out = in_flight.popleft()
        for o in sched.update_from_output(so, out):
            outputs.setdefault(o.request_id, []).append(o)
        check_invariants(sched)
    s2 = outputs["s2"]
    assert s2[-1].finish_reason.name == "ABORT" and not s2[-1].new_token_ids
    assert sum(o.finish_reason is not None for o in s2) == 1
    assert all(not o.finished for rid, outs in outputs.items() if rid != "s2" for o in outs)
    assert "s2" not in sched.requests and all(r.request_id != "s2" for r in sched.running)


def _trace(seed: int, steady: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    """A random workload's every scheduler output and step output, with or without the
    steady path (without: each request takes the full path every step)."""
    if not steady:
        original = KVCacheManager.allocate_slots

        def allocate(self, request, *args):
            blocks = original(self, request, *args)
            request.alloc_limit = request.block_room = 0
            return blocks

        monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate)
        # Nor the shortcuts taken at a block boundary: caching a completed block, applying
        # the token that completes it.
        monkeypatch.setattr(KVCacheManager, "cache_only_path", False)
        monkeypatch.setattr(KVCacheManager, "alloc_one_path", False)
        monkeypatch.setattr(Scheduler, "boundary_path", False)
        monkeypatch.setattr(
            Scheduler, "_set_check_at", lambda self, req: setattr(req, "check_at", 0)
        )
        # Every request looked up by id, none taken from schedule()'s record.
        monkeypatch.setattr(
            Scheduler, "_scheduled_requests", lambda self, so, req_ids: [_UNKNOWN] * len(req_ids)
        )
    rng = random.Random(seed)
    overlapped = seed % 2 == 1
    sched = make_scheduler(
        num_blocks=rng.choice([12, 24, 80]),
        block_size=rng.choice([1, 8, 16]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 24, 64]),
        max_model_len=rng.choice([48, 96]),
        enable_prefix_caching=seed % 3 != 2,
        policy="priority" if seed % 4 >= 2 else "fcfs",
        async_scheduling=overlapped,
    )

    def sample(rid: str, n: int) -> int:
        r = random.Random(f"{seed}/{rid}/{n}").random()
        return EOS if r < 0.04 else 5 + int(r * 4)

    runner = FakeRunner(sched, sample=sample)
    trace: list[bytes] = []
    in_flight: deque = deque()
    for i in range(6000):
        if i < 200 and rng.random() < 0.35:
            params: dict = {"max_tokens": rng.choice([None, rng.randint(1, 40)])}
            if rng.random() < 0.3:
                params["stop_token_ids"] = [rng.choice([6, 7])]
                params["min_tokens"] = rng.randint(0, params["max_tokens"] or 10)
            if rng.random() < 0.3:
                params["ignore_eos"] = True
            prefix = rng.choice([[], list(range(500, 516)), list(range(600, 627))])
            prompt = prefix + [rng.randrange(10, 50) for _ in range(rng.randint(1, 20))]
            sched.add_request(
                make_request(
                    f"r{i}", prompt, arrival_time=float(i), priority=rng.randint(0, 3), **params
                )
            )
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        work = sched.has_unfinished_requests() or sched.has_finished_requests()
        if i >= 200 and not work and not in_flight:
            break
        if work and len(in_flight) < (2 if overlapped else 1):
            so = sched.schedule()
            trace.append(msgspec.json.encode(so))
            if so.total_num_scheduled_tokens or so.finished_req_ids or not in_flight:
                in_flight.append((so, runner.execute(so)))
                if overlapped and len(in_flight) == 1 and so.total_num_scheduled_tokens:
                    continue
        if not in_flight:
            continue
        so, out = in_flight.popleft()
        for o in sched.update_from_output(so, out):
            o.prefill_chunks = [(0.0, n) for _, n in o.prefill_chunks]
            trace.append(msgspec.json.encode(o))
        trace.append(msgspec.json.encode(sched.make_stats()))
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    return b"\n".join(trace).decode()


@pytest.mark.parametrize("seed", range(12))
def test_steady_path_changes_nothing(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with_path = _trace(seed, True, monkeypatch)
    without = _trace(seed, False, monkeypatch)
    assert with_path == without


def _check_block_state(sched: Scheduler, so: SchedulerOutput) -> None:
    """After schedule(): every request it scheduled holds blocks for its computed tokens and
    no more, has every full block whose tokens are computed and known cached, and none beyond;
    the skip bounds (alloc_limit, block_room, cache_due_at) say exactly that."""
    kv, bs = sched.kv, sched.kv.block_size
    for req in sched.running:
        rid = req.request_id
        if rid not in so.num_scheduled_tokens:
            continue
        blocks = kv.req_to_blocks[rid]
        computed = req.num_computed_tokens
        assert len(blocks) * bs >= computed, rid
        assert len(blocks) == -(-computed // bs), rid  # no block before it is needed
        if kv.enable_caching:
            full = min(computed, req.num_tokens) // bs
            assert kv.num_cached_blocks.get(rid, 0) == full, (rid, computed, req.num_tokens)
            assert req.cache_due_at == (full + 1) * bs
            assert req.alloc_limit == min(len(blocks) * bs, (full + 1) * bs - 1)
        else:
            assert req.alloc_limit == len(blocks) * bs
        assert req.block_room == len(blocks) * bs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_skipped_steps_leave_nothing_to_allocate_or_cache(
    block_size: int, caching: bool, async_scheduling: bool
) -> None:
    """Every step the scheduler skips allocate_slots for (total <= alloc_limit, or past it
    within block_room with the last block's filling token in flight) is one where it would have
    allocated and cached nothing: off by one token either way, a block would come a step late
    (a write with no block) or be cached a step late (a prefix hit missed)."""
    sched = make_scheduler(
        block_size=block_size,
        enable_prefix_caching=caching,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=256,
    )
    for i, prompt_len in enumerate(range(1, 3 * block_size + 2)):
        sched.add_request(make_request(f"p{i}", prompt_len, max_tokens=4 * block_size + 3))
    runner = FakeRunner(sched)
    calls: list[tuple[str, int]] = []
    original = sched.kv.allocate_slots

    def allocate(req, n, *args):
        before = (len(sched.kv.req_to_blocks.get(req.request_id, ())),)
        before += (sched.kv.num_cached_blocks.get(req.request_id, 0),)
        blocks = original(req, n, *args)
        after = (len(sched.kv.req_to_blocks.get(req.request_id, ())),)
        after += (sched.kv.num_cached_blocks.get(req.request_id, 0),)
        # A decode that got its blocks (None: no room, a preemption follows).
        if req.num_computed_tokens >= req.prompt_len and n == 1 and not args and blocks is not None:
            calls.append((req.request_id, req.num_computed_tokens, req.num_tokens, before != after))
        return blocks

    sched.kv.allocate_slots = allocate  # type: ignore[method-assign]
    in_flight: deque = deque()
    for _ in range(1000):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()) and not in_flight:
            break
        so = sched.schedule()
        _check_block_state(sched, so)
        in_flight.append((so, runner.execute(so)))
        if async_scheduling and len(in_flight) < 2 and so.total_num_scheduled_tokens:
            continue
        so, out = in_flight.popleft()
        sched.update_from_output(so, out)
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    # A decode calls it only when it allocates or caches something.
    assert calls and all(c[-1] for c in calls), [c for c in calls if not c[-1]]


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
@pytest.mark.parametrize("salt", [None, "tenant"])
def test_one_block_hash_matches_the_general_hasher(algo: str, salt: str | None) -> None:
    from engine_core.block_hash import make_block_hasher
    from engine_core.request import Request
    from protocol.sampling_params import SamplingParams

    hasher = make_block_hasher(4, algo)
    fast = Request("a", list(range(10, 17)), SamplingParams(max_tokens=20), None, 0.0, 0, salt)
    fast._block_hasher = hasher
    general = Request("b", list(range(10, 17)), SamplingParams(max_tokens=20), None, 0.0, 0, salt)
    general._block_hasher = hasher
    for token in range(100, 114):
        fast.append_output_token(token)  # one block completes at a time: hash_next
        general.append_output_token_ids([token])  # the general hasher
        assert fast.block_hashes == general.block_hashes
        assert fast.next_hash_len == general.next_hash_len
    assert len(fast.block_hashes) == 21 // 4
