"""A client of a data-parallel group of engine cores: each request to the least loaded one.

Every engine core of the group (docs/scale-out.md) tells every client its waiting and running
counts and KV usage after each of its steps (the scheduler_stats of its OUTPUTS messages; ranks
send a stats-only OUTPUTS to clients that had no output in a step), so a client sees the
requests other clients placed too, without asking. A request goes to the engine with the lowest
score, weighted as vLLM's DP load balancer weighs it: waiting x 4 + running. A report is up to
a step old, so this client's own live requests on an engine (which it knows exactly) set a floor
under the reported total, the excess counted as waiting: a burst of requests spreads evenly
before any report says so. Ties go to the lower KV usage, then the lower rank. Prefix-cache
affinity is not attempted. A request and its n completions stay on their engine for their whole
life, aborts included.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from engine_core.client import AsyncEngineCoreClient, EngineDeadError, EngineRequestError
from protocol.engine_core import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    RequestError,
)

# What a sink receives: a step's outputs, a refusal, or (once) the group's failure.
OutputItem = EngineCoreOutputs | EngineRequestError | EngineDeadError

# vLLM's weighting: a waiting request costs more than a running one (it has a prefill ahead).
_WAITING_WEIGHT = 4


@dataclass
class _Load:
    waiting: int = 0  # as last reported
    running: int = 0
    kv_usage: float = 0.0
    mine: int = 0  # this client's live requests there (exact)

    def key(self) -> tuple[int, float]:
        waiting = max(self.waiting + self.running, self.mine) - self.running
        return waiting * _WAITING_WEIGHT + self.running, self.kv_usage


class DPEngineCoreClient:
    """asyncio client of N engine cores (ranks 0..N-1); build it with create()."""

    def __init__(self, engines: list[AsyncEngineCoreClient]) -> None:
        self.engines = engines
        self.ready: EngineCoreReady | None = engines[0].ready
        self._loads = [_Load() for _ in engines]
        self._engine_of: dict[str, int] = {}  # live engine request id -> rank
        self._outputs: asyncio.Queue[tuple[int, OutputItem]] = asyncio.Queue()
        self._sink: Callable[[int, OutputItem], None] = lambda rank, item: self._outputs.put_nowait(
            (rank, item)
        )
        for rank, engine in enumerate(engines):
            engine.set_output_sink(functools.partial(self._on_item, rank))

    @classmethod
    async def create(
        cls, addresses: list[str], *, startup_timeout: float = 300.0, client_name: str = ""
    ) -> DPEngineCoreClient:
        """Connect to every engine core (rank i at addresses[i]) and check they serve one model."""
        # A rank whose connection closes is gone (its host may have no pid to watch).
        tasks = [
            asyncio.create_task(
                AsyncEngineCoreClient.create(
                    a,
                    startup_timeout=startup_timeout,
                    client_name=client_name,
                    fail_on_disconnect=True,
                )
            )
            for a in addresses
        ]
        try:
            engines = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().shutdown()
                else:
                    task.cancel()
            raise
        first = engines[0].ready
        for rank, engine in enumerate(engines[1:], 1):
            ready = engine.ready
            if (ready.model_name, ready.max_model_len, ready.vocab_size) != (
                first.model_name,
                first.max_model_len,
                first.vocab_size,
            ):
                for e in engines:
                    e.shutdown()
                raise ConnectionError(
                    f"engine core rank {rank} at {addresses[rank]} serves {ready.model_name!r} "
                    f"(max_model_len {ready.max_model_len}, vocab {ready.vocab_size}), rank 0 "
                    f"{first.model_name!r} ({first.max_model_len}, {first.vocab_size}): every "
                    "rank of a data-parallel group must load the same model and limits"
                )
        return cls(engines)

    def pick_engine(self) -> int:
        """The rank a new request should go to: the least loaded."""
        return min(range(len(self.engines)), key=lambda r: self._loads[r].key())

    async def add_request(self, request: EngineCoreRequest, rank: int) -> None:
        """Send a request to engine `rank`; it stays there until it finishes."""
        self._engine_of[request.request_id] = rank
        self._loads[rank].mine += 1
        await self.engines[rank].add_request(request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests on the engines that hold them; unknown ids are ignored."""
        for rank, ids in self._per_rank(request_ids).items():
            await self.engines[rank].abort_requests(ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """abort_requests() from synchronous code (the sends never wait)."""
        for rank, ids in self._per_rank(request_ids).items():
            self.engines[rank].abort_requests_nowait(ids)

    def _per_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The live ones of request_ids, by the rank that holds them."""
        per_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._engine_of.get(request_id)
            if rank is not None:
                per_rank.setdefault(rank, []).append(request_id)
        return per_rank

    def forget(self, request_ids: list[str]) -> None:
        """Stop tracking requests whose end the caller saw outside get_output (refusals)."""
        for request_id in request_ids:
            self._release(request_id)

    def set_output_sink(self, sink: Callable[[int, OutputItem], None]) -> None:
        """Hand every later (rank, item) to sink as it arrives, in the loop's thread, instead
        of queueing it for get_output(): a step's outputs, an EngineRequestError for a refused
        request, an EngineDeadError (naming the rank) when an engine is gone. What is queued
        already goes first."""
        while not self._outputs.empty():
            sink(*self._outputs.get_nowait())
        self._sink = sink

    async def get_output(self) -> tuple[int, EngineCoreOutputs]:
        """(rank, outputs) of the next step any engine reported; EngineRequestError for a
        refused request, EngineDeadError (naming the rank) once any engine is gone."""
        rank, item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait((rank, item))  # every later caller sees the failure too
            raise item
        if isinstance(item, BaseException):
            raise item
        return rank, item

    def _on_item(self, rank: int, item: EngineCoreOutputs | RequestError | BaseException) -> None:
        """An engine's output, refusal or failure, as it arrives: the loads follow it."""
        out: OutputItem
        if isinstance(item, RequestError):
            self._release(item.request_id)
            out = EngineRequestError(item.request_id, item.message)
        elif isinstance(item, BaseException):
            message = str(item) if len(self.engines) == 1 else f"engine core rank {rank}: {item}"
            out = EngineDeadError(message)
        else:
            stats = item.scheduler_stats
            if stats is not None:
                load = self._loads[rank]
                load.waiting, load.running = stats.num_waiting_reqs, stats.num_running_reqs
                load.kv_usage = stats.kv_cache_usage
            for o in item.outputs:
                if o.finished:
                    self._release(o.request_id)
            out = item
        self._sink(rank, out)

    def _release(self, request_id: str) -> None:
        rank = self._engine_of.pop(request_id, None)
        if rank is not None:
            self._loads[rank].mine -= 1

    def shutdown(self) -> None:
        """Stop reading and close every engine's connection."""
        for engine in self.engines:
            engine.shutdown()
