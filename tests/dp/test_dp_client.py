"""DPEngineCoreClient's routing on scripted engines: the least loaded rank, pinned requests,
aborts to the right rank, a dead rank named."""

from __future__ import annotations

import asyncio

import pytest

from engine_core.client import EngineDeadError
from engine_core.dp_client import DPEngineCoreClient
from protocol.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from protocol.sampling_params import SamplingParams


class _Engine:
    """Stands in for an AsyncEngineCoreClient: records what it is sent, and hands what a test
    puts in `outputs` (outputs, or the failure) to the DP client's sink at once."""

    def __init__(self) -> None:
        self.ready = None
        self.added: list[str] = []
        self.aborted: list[str] = []
        self._sink = None
        self.outputs = self  # tests push with outputs.put_nowait(item)

    def set_output_sink(self, sink) -> None:
        self._sink = sink

    def put_nowait(self, item: EngineCoreOutputs | BaseException) -> None:
        self._sink(item)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    async def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids

    def abort_requests_nowait(self, ids: list[str]) -> None:
        self.aborted += ids

    def shutdown(self) -> None:
        pass


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


def _load(waiting: int, running: int, kv: float = 0.0) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        [], SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv)
    )


def test_routing_follows_the_published_load_and_pins_requests() -> None:
    async def run() -> None:
        engines = [_Engine(), _Engine()]
        client = DPEngineCoreClient(engines)  # type: ignore[arg-type]
        # Idle: rank 0, then rank 1 (before any report, this client's own requests count).
        for name in ("a", "b"):
            await client.add_request(_request(name), client.pick_engine())
        assert (engines[0].added, engines[1].added) == (["a"], ["b"])
        # Rank 0 reports 2 running, rank 1 one waiting (x 4): rank 0 is less loaded.
        engines[0].outputs.put_nowait(_load(0, 2))
        engines[1].outputs.put_nowait(_load(1, 0))
        assert {(await client.get_output())[0] for _ in range(2)} == {0, 1}
        assert client.pick_engine() == 0
        # Equal scores: the lower KV usage wins.
        engines[0].outputs.put_nowait(_load(0, 1, kv=0.5))
        engines[1].outputs.put_nowait(_load(0, 1, kv=0.1))
        for _ in range(2):
            await client.get_output()
        assert client.pick_engine() == 1
        # A report lower than this client's own live requests does not hide them: rank 1 has
        # "b" and two more of ours, reported as 1 running, so the other two count as waiting.
        for name in ("c", "d"):
            await client.add_request(_request(name), 1)
        assert client.pick_engine() == 0
        # Aborts go where the request lives; a finished request is forgotten.
        await client.abort_requests(["b", "a", "unknown"])
        assert (engines[0].aborted, engines[1].aborted) == (["a"], ["b"])
        done = EngineCoreOutput("a", [], finish_reason=FinishReason.ABORT)
        engines[0].outputs.put_nowait(EngineCoreOutputs([done]))
        assert (await client.get_output())[0] == 0
        await client.abort_requests(["a"])
        assert engines[0].aborted == ["a"]
        client.shutdown()

    asyncio.run(run())


def test_a_dead_rank_fails_get_output_naming_it() -> None:
    async def run() -> None:
        engines = [_Engine(), _Engine()]
        client = DPEngineCoreClient(engines)  # type: ignore[arg-type]
        engines[1].outputs.put_nowait(EngineDeadError("the engine core process 42 exited"))
        for _ in range(2):  # every later call fails too
            with pytest.raises(EngineDeadError, match="rank 1: the engine core process 42"):
                await client.get_output()
        client.shutdown()

    asyncio.run(run())
