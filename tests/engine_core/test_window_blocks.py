"""Blocks freed behind a model-wide sliding window (engine_core/kv_cache_manager.py): a request
decoding or prefilling past the window holds a bounded number of blocks, so a KV cache too
small for its whole sequence runs it without preemption; freed blocks stay in the prefix cache,
and a later request sharing the prefix takes only the hits inside its first window. The fake
runner reads what the kernels read (the keys from each step's first query's window on) and
fails on a block that was freed and reused before it was read."""

from __future__ import annotations

import random

import pytest

from config.cache import CacheConfig
from config.engine import EngineConfig
from config.kv_window import blocks_one_request_needs, model_wide_window
from config.model import ModelConfig
from config.model_arch import ModelArchConfig
from config.scheduler import SchedulerConfig
from engine_core.scheduler import Scheduler
from tests.engine_core.test_async_scheduling import _drive, _sampler, _workload
from tests.engine_core.test_scheduler_random import check_invariants
from tests.engine_core.utils import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    windowed_arch,
)

BS = 8
WINDOW = 20


def _held(sched: Scheduler, req_id: str) -> int:
    """Real blocks (not the null entries) the request holds."""
    null = sched.kv.pool.null_block
    return sum(b is not null for b in sched.kv.req_to_blocks.get(req_id, ()))


def _bound(window: int, tokens_per_step: int) -> int:
    """Blocks of the window before a step's first query and of the step's own tokens."""
    return -(-(window - 1 + tokens_per_step) // BS) + 1


def _run_one(sched: Scheduler, prompt: int, max_tokens: int) -> list[int]:
    """Run one request to its end; the real blocks it held after each step."""
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", prompt, max_tokens=max_tokens, ignore_eos=True))
    held = []
    while sched.has_unfinished_requests():
        step(sched, runner)
        held.append(_held(sched, "a"))
        check_invariants(sched)
    return held


@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
def test_decode_past_the_window_frees_blocks_and_stays_bounded(caching):
    # 10 + 200 tokens need 27 blocks of 8; the pool has 6.
    sched = make_scheduler(
        num_blocks=6,
        block_size=BS,
        max_model_len=256,
        enable_prefix_caching=caching,
        sliding_window=WINDOW,
    )
    held = _run_one(sched, 10, 200)
    assert max(held[1:-1]) <= _bound(WINDOW, 1)
    assert sched._num_preemptions == 0
    assert sched.kv.num_free_blocks == 6
    # Without the window the same request holds every block of its sequence.
    full = make_scheduler(num_blocks=64, block_size=BS, max_model_len=256)
    assert max(_run_one(full, 10, 200)) == 26  # 208 computed tokens before the last step


def test_long_prompt_chunks_fit_a_pool_of_the_bound():
    # A 150-token prompt in chunks of 16 with a pool of exactly the bound: no preemption.
    budget = 16
    num_blocks = _bound(WINDOW, budget)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_batched_tokens=budget,
        max_model_len=256,
        sliding_window=WINDOW,
    )
    held = _run_one(sched, 150, 40)
    assert max(held) <= num_blocks < -(-190 // BS)
    assert sched._num_preemptions == 0


def test_later_request_takes_only_the_hits_inside_its_window():
    sched = make_scheduler(num_blocks=40, block_size=BS, max_model_len=256, sliding_window=WINDOW)
    runner = FakeRunner(sched)
    prompt = [random.Random(1).randrange(10, 30000) for _ in range(64)]
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    pool, null = sched.kv.pool, sched.kv.pool.null_block
    assert len(pool.cached) == 8  # every full block, the ones freed behind the window too
    sched.add_request(make_request("b", prompt + [7, 8, 9], max_tokens=4))
    _, first = step(sched, runner)
    assert sched.requests["b"].num_cached_tokens == 64
    blocks = sched.kv.req_to_blocks["b"]
    # 64 tokens hit; the first computed query (at 64) sees 45..64: blocks 0-4 are not taken.
    assert blocks[:5] == [null] * 5
    assert all(b is not null and b.ref_cnt == 1 for b in blocks[5:])
    assert all(pool.cached[h].ref_cnt == 0 for h in sched.requests["b"].block_hashes[:5])
    out = run_to_completion(sched, runner)
    assert len(first["b"].new_token_ids + out["b"]) == 4 and sched.kv.num_free_blocks == 40


def test_evicted_block_ends_the_hit():
    # A tiny pool: the second request's own blocks evict the first's freed ones, oldest first.
    sched = make_scheduler(num_blocks=6, block_size=BS, max_model_len=256, sliding_window=WINDOW)
    runner = FakeRunner(sched)
    prompt = [random.Random(2).randrange(10, 30000) for _ in range(40)]
    sched.add_request(make_request("a", prompt, max_tokens=60, ignore_eos=True))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt + [1], max_tokens=2))
    step(sched, runner)
    assert sched.requests["b"].num_cached_tokens == 0  # block 0 was evicted first
    run_to_completion(sched, runner)
    assert sched.kv.num_free_blocks == 6


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_with_a_window_return_every_block(seed):
    rng = random.Random(seed)
    make = dict(
        num_blocks=rng.choice([8, 12, 24]),
        block_size=BS,
        max_num_seqs=rng.choice([2, 4]),
        max_num_batched_tokens=rng.choice([8, 24]),
        max_model_len=96,
        enable_prefix_caching=seed % 3 != 2,
        policy="priority" if seed % 2 else "fcfs",
        sliding_window=rng.choice([1, 9, WINDOW, 33]),
    )
    results = []
    for overlapped in (False, True):
        sched = make_scheduler(**make, async_scheduling=overlapped)
        runner = FakeRunner(sched, sample=_sampler)
        for req in _workload(random.Random(seed), 30):
            sched.add_request(req)
        results.append(_drive(sched, runner, overlapped))
        assert sched.kv.num_free_blocks == make["num_blocks"]
    assert results[0] == results[1]


def _arch(**fields) -> ModelArchConfig:
    base = {
        "architectures": ["X"],
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    return ModelArchConfig.from_dict({**base, **fields})


def test_model_wide_window_only_where_every_layer_slides():
    assert model_wide_window(windowed_arch(64), 4096) == 64
    assert model_wide_window(windowed_arch(64), 64) is None  # no sequence outgrows it
    assert model_wide_window(_arch(), 4096) is None
    assert model_wide_window(None, 4096) is None
    hybrid = ["sliding_attention", "full_attention"] * 2
    assert model_wide_window(_arch(sliding_window=64, layer_types=hybrid), 4096) is None
    every = ["sliding_attention"] * 4
    assert model_wide_window(_arch(sliding_window=64, layer_types=every), 4096) == 64
    qwen2 = {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}
    assert model_wide_window(_arch(**qwen2, max_window_layers=2), 4096) is None
    assert model_wide_window(_arch(**qwen2, max_window_layers=0), 4096) == 64
    assert model_wide_window(_arch(**{**qwen2, "use_sliding_window": False}), 4096) is None


def test_blocks_one_request_needs():
    def config(window: int | None, max_model_len: int, tokens: int) -> EngineConfig:
        cfg = EngineConfig(
            model=ModelConfig(max_model_len=max_model_len),
            cache=CacheConfig(block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=tokens),
        )
        cfg.arch = windowed_arch(window) if window else _arch()
        return cfg

    assert blocks_one_request_needs(config(None, 4096, 2048)) == 256
    assert blocks_one_request_needs(config(4096, 32768, 2048)) == 385  # (4095 + 2048) / 16 + 1
    assert blocks_one_request_needs(config(16, 4096, 16)) == 3  # 31 keys may span 3 blocks
    assert blocks_one_request_needs(config(1000, 1024, 2048)) == 64  # never past max_model_len
