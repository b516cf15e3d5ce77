"""Helpers for scheduler tests: configs, requests and a fake runner over a simulated KV cache."""

from __future__ import annotations

import random
from collections.abc import Callable

from config.cache import CacheConfig
from config.engine import EngineConfig
from config.model import ModelConfig
from config.model_arch import ModelArchConfig
from config.scheduler import SchedulerConfig
from engine_core.scheduler import Scheduler
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
from protocol.step import ModelRunnerOutput, SchedulerOutput

EOS = 2
SAMPLED = 5


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 8,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    hash_algo: str = "sha256",
    async_scheduling: bool = False,
    sliding_window: int | None = None,
) -> Scheduler:
    """A Scheduler on a small EngineConfig; sliding_window: of every layer of its (made-up)
    model, so the KV cache manager frees blocks behind it."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=hash_algo,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=policy,
            async_scheduling=async_scheduling,
        ),
    )
    if sliding_window is not None:
        config.arch = windowed_arch(sliding_window)
    return Scheduler(config, num_blocks, EOS)


def windowed_arch(sliding_window: int, num_layers: int = 2) -> ModelArchConfig:
    """A Mistral-shaped ModelArchConfig whose every layer attends within sliding_window."""
    return ModelArchConfig.from_dict(
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "sliding_window": sliding_window,
        }
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    **params,
) -> EngineCoreRequest:
    """An EngineCoreRequest; an int prompt means that many random tokens seeded by req_id."""
    if isinstance(prompt, int):
        rng = random.Random(req_id)
        prompt = [rng.randrange(10, 30000) for _ in range(prompt)]
    params.setdefault("max_tokens", 16)
    return EngineCoreRequest(
        req_id,
        prompt,
        SamplingParams(**params),
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


class _Row:
    __slots__ = ("tokens", "num_prompt", "computed", "blocks", "chain")

    def __init__(
        self, tokens: list[int], num_prompt: int, computed: int, blocks: list[int]
    ) -> None:
        self.tokens, self.num_prompt = tokens, num_prompt
        self.computed, self.blocks = computed, blocks
        self.chain: list[int] = []

    def expected_kv(self, pos: int) -> int:
        """What the KV of position pos holds: a chained hash of tokens[:pos + 1]."""
        while len(self.chain) <= pos:
            i = len(self.chain)
            self.chain.append(hash((self.chain[-1] if i else 0, self.tokens[i])))
        return self.chain[pos]


class FakeRunner:
    """Consumes SchedulerOutputs as gpu_worker's runner does and checks the contract.

    The KV cache is simulated: position p of a request stores a hash of its tokens up to p, so
    reading a block that another request overwrote, or that nobody computed, fails an assert.
    With the scheduler's model-wide sliding window W, a step reads (as the kernels do) only the
    keys from its first query's window on (computed - W + 1): entries before it may be freed.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        sample: Callable[[str, int], int] = lambda req_id, num_outputs: SAMPLED,
    ) -> None:
        self.block_size = scheduler.kv.block_size
        self.max_num_seqs = scheduler.max_num_seqs
        self.budget = scheduler.max_num_batched_tokens
        self.max_model_len = scheduler.max_model_len
        self.window = scheduler.kv.sliding_window
        self.kv: dict[int, int] = {}
        self.rows: dict[str, _Row] = {}
        self.sample = sample

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update rows, check limits, write and read the fake KV, sample."""
        for req_id in so.finished_req_ids:
            self.rows.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.rows[new.req_id] = _Row(
                new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids),
                new.num_computed_tokens,
                list(new.block_ids),
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.rows[req_id]
            assert row.computed == computed, (req_id, row.computed, computed)
            row.blocks.extend(block_ids)
        assert len(self.rows) <= self.max_num_seqs
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        assert so.total_num_scheduled_tokens <= self.budget
        bs = self.block_size
        written: dict[int, str] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            row = self.rows[req_id]
            end = row.computed + n
            assert n >= 1 and end <= len(row.tokens) <= self.max_model_len, (req_id, n)
            live = row.blocks[self._first_read(row.computed) // bs :]
            assert len(row.blocks) * bs >= end and len(set(live)) == len(live)
            for pos in range(row.computed, end):
                slot = row.blocks[pos // bs] * bs + pos % bs
                assert slot not in written, f"{req_id} and {written[slot]} write slot {slot}"
                written[slot] = req_id
                self.kv[slot] = row.expected_kv(pos)
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():  # reads follow all writes, as per layer
            row = self.rows[req_id]
            first = self._first_read(row.computed)
            row.computed += n
            for pos in range(first, row.computed):
                slot = row.blocks[pos // bs] * bs + pos % bs
                assert self.kv.get(slot) == row.expected_kv(pos), f"{req_id}: stale KV at {pos}"
            if row.computed == len(row.tokens):
                token = self.sample(req_id, len(row.tokens) - row.num_prompt)
                row.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=list(so.num_scheduled_tokens),
            sampled_token_ids=sampled,
            logprobs=[None] * len(sampled),
        )

    def _first_read(self, computed: int) -> int:
        """The first position a step whose first query is at `computed` reads."""
        return 0 if self.window is None else max(computed - self.window + 1, 0)


def step(scheduler: Scheduler, runner: FakeRunner):
    """One engine step; returns (SchedulerOutput, outputs by request id)."""
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, runner.execute(so))
    return so, {o.request_id: o for o in outputs}


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict:
    """Step until no request is left; returns every request's output token ids."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        _, outs = step(scheduler, runner)
        for req_id, out in outs.items():
            tokens.setdefault(req_id, []).extend(out.new_token_ids)
    raise AssertionError("requests did not finish")
