"""--async-scheduling through the real engine: the model runs step N while the engine schedules
step N+1, in the engine's own process (a model thread), with worker processes, and inside an
engine core process; every path gives the synchronous engine's tokens and finish reasons."""

from __future__ import annotations

import pytest

from engine_core.client import EngineCoreClient
from engine_core.inproc_client import InprocClient
from engine_core.resolve import resolved_config
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
from tests.engine_core_proc.utils import PROMPTS, collect

# Greedy requests that end every way: length caps, stop ids (taken from the synchronous run's
# own tokens so they are really hit), min_tokens holding a stop back, and EOS allowed.
MAX_TOKENS = [3, 47, 9, 60, 1, 32, 55, 26]


def _requests(stop_ids: dict[int, int]) -> list[EngineCoreRequest]:
    reqs = []
    for i, max_tokens in enumerate(MAX_TOKENS):
        params = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=i % 3 != 0)
        if i in stop_ids:
            params["stop_token_ids"] = [stop_ids[i]]
            params["min_tokens"] = 2 if i % 2 else 0
        reqs.append(
            EngineCoreRequest(
                f"q{i}", PROMPTS[i % len(PROMPTS)] * (2 + i % 3), SamplingParams(**params)
            )
        )
    return reqs


def _run(client, reqs: list[EngineCoreRequest]) -> dict:
    for req in reqs:
        client.add_request(req)
    return collect(client, {r.request_id for r in reqs})


@pytest.fixture(scope="module")
def expected(engine_args):
    """The synchronous engine's results, with stop ids chosen from its own outputs."""
    sync = InprocClient(resolved_config(**engine_args))
    plain = _run(sync, _requests({}))
    stop_ids = {
        i: plain[f"q{i}"][0][len(plain[f"q{i}"][0]) // 2]
        for i in (1, 3, 6)
        if len(plain[f"q{i}"][0]) > 4
    }
    results = _run(sync, [_with_id(r, "again") for r in _requests(stop_ids)])
    sync.shutdown()
    reasons = [reason.name for _, reason in results.values()]
    assert len(stop_ids) == 3 and reasons.count("STOP") >= 3 and "LENGTH" in reasons
    return stop_ids, {rid.removeprefix("again"): v for rid, v in results.items()}


def _with_id(req: EngineCoreRequest, prefix: str) -> EngineCoreRequest:
    return EngineCoreRequest(prefix + req.request_id, req.prompt_token_ids, req.sampling_params)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_num_batched_tokens": 24, "max_num_seqs": 3},  # chunked prefill, fewer rows
        {"num_gpu_blocks_override": 16, "enable_prefix_caching": False},  # preemption
        {"distributed_executor_backend": "mp"},  # the worker in its own process
    ],
    ids=["uni", "chunked", "preempting", "mp"],
)
def test_in_process_engine_matches_synchronous(engine_args, expected, extra):
    stop_ids, want = expected
    client = InprocClient(resolved_config(**engine_args, **extra, async_scheduling=True))
    engine = client.engine_core
    depths = []
    submit = engine.executor.submit

    def recording_submit(scheduler_output):
        depths.append(len(engine._in_flight))
        return submit(scheduler_output)

    engine.executor.submit = recording_submit
    try:
        got = _run(client, _requests(stop_ids))
        assert got == want
        assert max(depths) == 1, "a step should be submitted while the previous one runs"
        if "num_gpu_blocks_override" in extra:
            assert engine.totals.num_preemptions > 0, "the KV cache should force preemption"
        for _ in range(3):  # the step in flight when the last request ended, the finished ids
            if engine.has_unfinished_requests():
                assert not engine.step().outputs
        assert not engine.has_unfinished_requests() and not engine._in_flight
        assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    finally:
        client.shutdown()


def test_engine_core_process_with_async_scheduling(engine_args, expected):
    stop_ids, want = expected
    with EngineCoreClient(engine_args={**engine_args, "async_scheduling": True}) as client:
        assert _run(client, _requests(stop_ids)) == want
        assert client.call_utility("get_stats")["num_unfinished_requests"] == 0
