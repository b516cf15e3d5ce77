"""Dummy steps before serving: the profile run that sizes the KV cache, and the warm-up that
compiles every kernel variant the engine will meet, so no request pays a compile.

Dummy requests go through the runner's real path (request state, input preparation, forward,
sampler) with made-up token ids and block ids, and are finished afterwards; what they wrote
into the KV cache is garbage that real requests overwrite, and the engine core's prefix cache
never heard of it. The runner hands in its step (execute) and the limits a step keeps to; this
module never sees the runner.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from config.engine import EngineConfig
from protocol.sampling_params import SamplingParams
from protocol.step import CachedRequestData, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

# What the profile run samples with: every stage that allocates per row (sorting for top-p,
# top-k, penalties' counts), so the measured peak covers a real step's sampler.
PROFILE_SAMPLING = SamplingParams(
    temperature=0.5, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1, ignore_eos=True
)
_GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
_ids = itertools.count()

# Runs one step and waits for it (the runner's execute_model).
Execute = Callable[[SchedulerOutput], object]


@dataclass(frozen=True, slots=True)
class DummyLimits:
    """What dummy steps keep to: the scheduler's limits, the KV block size, the vocabulary."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: EngineConfig) -> DummyLimits:
        """The limits of a resolved configuration."""
        sched = config.scheduler
        assert config.arch is not None and sched.max_num_batched_tokens is not None
        return cls(
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            config.cache.block_size,
            config.arch.vocab_size,
        )


def run_dummy(
    execute: Execute,
    limits: DummyLimits,
    prompt_lens: list[int],
    decode_steps: int,
    num_blocks: int,
    params: SamplingParams = _GREEDY,
) -> int:
    """Prefill one dummy request per prompt length (packed into steps within the token
    budget, chunked where a prompt exceeds it), decode all of them decode_steps times, then
    finish them, each step through execute; returns the number of steps run."""
    steps = 0
    for sched in _dummy_steps(limits, prompt_lens, decode_steps, num_blocks, params):
        execute(sched)
        steps += 1
    return steps


def _dummy_steps(
    limits: DummyLimits,
    prompt_lens: list[int],
    decode_steps: int,
    num_blocks: int,
    params: SamplingParams,
) -> Iterator[SchedulerOutput]:
    budget = limits.max_num_batched_tokens
    block_size, vocab = limits.block_size, limits.vocab_size
    prefix = f"__warmup-{next(_ids)}-"
    reqs = [f"{prefix}{i}" for i in range(len(prompt_lens))]
    total = dict(zip(reqs, prompt_lens))
    computed = dict.fromkeys(reqs, 0)
    blocks: dict[str, list[int]] = {r: [] for r in reqs}
    free = itertools.cycle(range(num_blocks))
    seen: set[str] = set()

    def step(wanted: dict[str, int]) -> SchedulerOutput:
        news, cached = [], CachedRequestData()
        for r, n in wanted.items():
            grown = [
                next(free) for _ in range(-(-(computed[r] + n) // block_size) - len(blocks[r]))
            ]
            blocks[r] += grown
            if r not in seen:
                seen.add(r)
                # The same ids on every rank (tensor parallelism runs these steps in lockstep).
                prompt = [(31 * len(seen) + j) % vocab for j in range(total[r])]
                news.append(NewRequestData(r, prompt, params, list(blocks[r]), 0))
            else:
                cached.req_ids.append(r)
                cached.new_block_ids.append(grown)
                cached.num_computed_tokens.append(computed[r])
            computed[r] += n
        return SchedulerOutput(
            scheduled_new_reqs=news,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=wanted,
            total_num_scheduled_tokens=sum(wanted.values()),
        )

    pending = list(reqs)
    while pending:  # prefill, packed within the budget
        wanted: dict[str, int] = {}
        room = budget
        for r in list(pending):
            n = min(total[r] - computed[r], room)
            if n <= 0 or len(wanted) >= limits.max_num_seqs:
                break
            wanted[r] = n
            room -= n
            if computed[r] + n == total[r]:
                pending.remove(r)
        yield step(wanted)
    for _ in range(decode_steps):
        for r in reqs:
            total[r] += 1
        yield step(dict.fromkeys(reqs, 1))
    yield SchedulerOutput(finished_req_ids=reqs)


def warm_up(
    execute: Execute,
    limits: DummyLimits,
    max_model_len: int,
    num_blocks: int,
    device: torch.device,
    long_context: int,
) -> None:
    """Run every step shape of warm_up_shapes() once through execute, over a KV cache of
    num_blocks blocks, and wait for the device; logs the steps and the time they took.
    long_context: the context length from which attention takes another path (the backend's
    warm_up_context_len; 0: none)."""
    start = time.perf_counter()
    groups = warm_up_shapes(
        limits.max_num_seqs, limits.max_num_batched_tokens, max_model_len, long_context
    )
    steps = sum(run_dummy(execute, limits, lens, decodes, num_blocks) for lens, decodes in groups)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warm-up: %d dummy steps in %.1f s", steps, time.perf_counter() - start)


def warm_up_shapes(
    max_num_seqs: int, budget: int, max_model_len: int, long_context: int
) -> list[tuple[list[int], int]]:
    """(prompt lengths, decode steps) of each warm-up group: prefill chunks of every query
    length class the kernels tile differently (powers of two up to 128, and a full budget; a
    mixed step compiles as the chunk of its longest query), decode batches of 1, 2, 4, 8, then
    multiples of 8 up to max_num_seqs, and one decode at the long_context length where the
    attention backend takes another path from there (0: none)."""
    cap = min(budget, max_model_len - 1)
    groups: list[tuple[list[int], int]] = [
        ([q], 0) for q in (1, 2, 4, 8, 16, 32, 64, 128, cap) if q <= cap
    ]
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8))
    groups += [([1] * b, 1) for b in sizes if b <= max_num_seqs]
    if long_context and long_context < max_model_len:
        groups.append(([long_context], 1))
    return groups
